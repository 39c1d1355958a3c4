"""The `hetero` command line: one module per command group, `main` here.

Every deliberate error (`HeteroError`) becomes one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from hetero.errors import HeteroError
from hetero.threads import passive_openmp

__all__ = ["build_parser", "main"]


def _version() -> str:
    """The installed distribution's version (what pip installed), else the package's own."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hetero")
    except PackageNotFoundError:
        from hetero import __version__

        return __version__


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of `argv`'s command (default sys.argv), or of every command when none is given."""
    parser = argparse.ArgumentParser(prog="hetero", description="Fast LLM prefill on NPU + CPU/GPU (mllm-NPU).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what hetero decides (and, for run, where the time went)")
    parser.add_argument("--version", action="version", version=f"hetero {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    command = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    groups = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for group in groups:  # only the given command's module: `hetero run` imports no benchmark (issue 28)
        importlib.import_module(f"hetero.cli.{group}").register(sub)
    return parser


# command -> the module of `hetero.cli` that registers it
COMMANDS = {"run": "run", "info": "run", "calibrate": "calibrate", "npu": "npu", "profile": "profile",
            "timeline": "profile", "bench": "bench", "serve": "serve", "cache": "cache"}


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (None: this process's, whose start-up `hetero -v run` then reports)."""
    passive_openmp()  # the edge: before a command module loads torch (hetero/threads.py)
    args = build_parser(argv).parse_args(argv)
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
        rc = int(args.func(args) or 0)
    except HeteroError as e:
        print(f"hetero: error: {e}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:
        rc = 130
    if argv is None:
        _end_process(rc)
    return rc


def _end_process(rc: int) -> None:
    """End this command's process now: its results are printed and its cache files written (atomically), and
    the exit handlers run (logging, temp folders, the decode helper's stop); what is skipped is the teardown of
    every object, ~100 ONNX Runtime sessions, torch's and numba's state: 0.8-0.9 s of a warm `hetero run`
    (issue 28), for nothing."""
    import atexit
    import os

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
