"""The standalone entry of a benchmark module (`bench/<name>.py`): parse, run, one-line errors."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from hetero.errors import HeteroError


def bench_main(prog: str, description: str, add_args: Callable[[argparse.ArgumentParser], None],
               run: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    """`python bench/<prog>.py ...`: the same arguments and run as `hetero bench <prog>`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(run(args) or 0)
    except HeteroError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
