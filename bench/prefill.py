"""Prefill benchmark: hetero vs hetero in-order vs naive NPU vs torch float vs llama.cpp (issue 6).

    python bench/prefill.py [--quick] [--json] [--lens 64,256,1024,2048] [--repeats 3] [--threads 2]

Same as `hetero bench prefill`; writes bench/results/prefill.{json,md} and prefill_*.png.
"""

import sys

from hetero.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "prefill", *sys.argv[1:]]))
