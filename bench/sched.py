"""Scheduling policies vs the lower bound and CP-SAT (mllm-NPU §3.4), simulated; `hetero.bench.sched`.

    python bench/sched.py --json          # writes bench/results/sched.{json,md} and timeline PNGs
    python bench/sched.py --quick         # fewer prompt lengths, short solver limit
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("sched", sys.argv[1:]))
