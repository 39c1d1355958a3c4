"""One chunk's attention: hetero's BF16 kernel beside ONNX Runtime's GroupQueryAttention (issue 24); `hetero.bench.attention_kernel`.

    python bench/attention_kernel.py --out bench/results   # writes bench/results/attention_kernel.{json,md}
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("attention_kernel", sys.argv[1:]))
