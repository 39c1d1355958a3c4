"""The `hetero` command line: one module per command group, `main` here.

Every deliberate error (`HeteroError`) becomes one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from hetero.cli.args import add_method_arg, add_model_arg, int_list, positive_int
from hetero.errors import HeteroError

__all__ = ["add_method_arg", "add_model_arg", "build_parser", "int_list", "main", "positive_int"]


def _version() -> str:
    """The installed distribution's version (what pip installed), else the package's own."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hetero")
    except PackageNotFoundError:
        from hetero import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetero", description="Fast LLM prefill on NPU + CPU/GPU (mllm-NPU).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what hetero decides (and, for run, where the time went)")
    parser.add_argument("--version", action="version", version=f"hetero {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    from hetero.cli import bench, calibrate, npu, run, sched, serve  # here: hetero.bench imports hetero.cli.args

    for group in (run, calibrate, npu, sched, bench, serve):
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (None: this process's, whose start-up `hetero -v run` then reports)."""
    args = build_parser().parse_args(argv)
    if argv is None:  # the process is this command: its age now is Python's start, the imports and the parser
        from hetero.timing import process_age_s

        args.startup_s = process_age_s()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    try:
        return int(args.func(args) or 0)
    except HeteroError as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
