"""Where a prefill's time goes, per subgraph kind and per lane (issue 11); `hetero.bench.prefill_parts`.

    python bench/prefill_parts.py                          # 64, 256, 1024, 2048 tokens; prints a table
    python bench/prefill_parts.py --out bench/results      # also writes prefill_parts.{json,md}
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("prefill_parts", sys.argv[1:]))
