"""Accuracy of the W8A8 + shadow-outlier path vs float and mllm-NPU Table 5's baselines; `hetero.bench.accuracy`.

    python bench/accuracy.py [--quick] [--json]      # writes bench/results/accuracy.{json,md,png}
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("accuracy", sys.argv[1:]))
