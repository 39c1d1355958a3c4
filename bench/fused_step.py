"""A decode step as one ONNX Runtime run, synthetic weights: a design probe (issue 13); `hetero.bench.fused_step`.

    python bench/fused_step.py                          # contexts 256, 1024, 2048; prints a table
    python bench/fused_step.py --out bench/results      # also writes fused_step.{json,md}
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("fused_step", sys.argv[1:]))
