"""A decode step's layer graphs with ONNX Runtime's 4-bit MatMulNBits weights vs hetero's INT8 graphs (issue 24 item 3); `hetero.bench.decode_int4_probe`.

    python bench/decode_int4_probe.py                    # times, bytes, errors, greedy agreement; prints a table
    python bench/decode_int4_probe.py --out bench/results  # also writes decode_int4_probe.{json,md}
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("decode_int4_probe", sys.argv[1:]))
