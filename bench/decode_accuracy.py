"""Teacher-forced decode perplexity and greedy agreement of the decode forms (issue 24); `hetero.bench.decode_accuracy`.

    python bench/decode_accuracy.py --texts austen,FILE.txt    # prints a table
    python bench/decode_accuracy.py --out bench/results      # also writes decode_accuracy.{json,md}
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetero.bench.entry import bench_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_main("decode_accuracy", sys.argv[1:]))
