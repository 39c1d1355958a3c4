"""One plain decode step's time at given contexts and its parts (issue 13); `hetero.bench.decode_step`.

    python bench/decode_step.py                          # contexts 256, 1024, 2048; prints a table
    python bench/decode_step.py --out bench/results      # also writes decode_step.{json,md}
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("decode_step", sys.argv[1:]))
