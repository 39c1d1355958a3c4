"""`hetero serve` under a multi-turn chat workload (LLMS + Pensieve); `hetero.bench.service`.

    python bench/service.py            # writes bench/results/service.{json,md}
    python bench/service.py --quick    # a few minutes: 2 + 4 conversations, phases 1 and 2, in the temp dir
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("service", sys.argv[1:]))
