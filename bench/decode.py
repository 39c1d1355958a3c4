"""Decode: hetero's own decoder vs HF generate vs llama.cpp, plain and speculative; `hetero.bench.decode`.

    python bench/decode.py [--quick] [--repeats 3] [--threads 2] [--new 32]   # writes bench/results/decode.{json,md,png}
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("decode", sys.argv[1:]))
