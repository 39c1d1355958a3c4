"""Sliding-window layers: keep only the window, or every position with a mask (issue 25); `hetero.bench.window_layout`.

    python bench/window_layout.py                          # Gemma 3 270M and a tiny Mistral at 2048, 4096; a table
    python bench/window_layout.py --out bench/results      # also writes window_layout.{json,md}
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("window_layout", sys.argv[1:]))
