"""Memory benchmark: resident memory per stage of a hetero and a torch float prefill, fresh process each.

    python bench/memory.py [--lens 64,256,1024,2048] [--threads 2]

Writes bench/results/memory.{json,md} (the same run as `hetero bench memory`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("memory", sys.argv[1:]))
