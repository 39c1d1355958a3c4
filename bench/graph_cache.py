"""Prebuilt-graph cache and chunk sharing, measured (mllm-NPU §3.2); `hetero.bench.graph_cache`.

    python bench/graph_cache.py --json            # writes bench/results/graph_cache.json too
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("graph_cache", sys.argv[1:]))
