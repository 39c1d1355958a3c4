"""A warm `hetero run` end to end beside llama.cpp, with hetero's phases (issue 28); `hetero.bench.startup`.

    python bench/startup.py --out bench/results       # writes bench/results/startup.{json,md}
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("startup", sys.argv[1:]))
