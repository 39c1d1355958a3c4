"""The `hetero` command line: one module per command group, `main` here.

Every deliberate error (`HeteroError`) becomes one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import sys
from typing import Any

from hetero import progress
from hetero.errors import HeteroError
from hetero.threads import passive_openmp

__all__ = ["add_command", "build_parser", "main", "start_up_done"]


def _version() -> str:
    """The installed distribution's version (what pip installed), else the package's own."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hetero")
    except PackageNotFoundError:
        from hetero import __version__

        return __version__


class _Version(argparse.Action):
    """--version: the version read when asked (importlib.metadata costs ~25 ms of every command's start)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(f"hetero {_version()}")
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), whose usage errors are one line on stderr, which argument and what
    it expected, and exit code 2, as every other bad input (`--help` shows the usage)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"hetero: error: {message} (`{self.prog} --help` shows the usage)\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of `argv`'s command (default sys.argv): only that command's module is imported (`hetero run`
    imports no benchmark); with no known command (`--help`, `--version`) every command is listed by its help
    line alone, so that these answer without importing torch, numba or ONNX Runtime."""
    parser = _Parser(prog="hetero", description="Fast LLM prefill on NPU + CPU/GPU (mllm-NPU).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what hetero decides (and, for run, where the time went)")
    parser.add_argument("--version", action=_Version, nargs=0, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    command = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    if command in COMMANDS:
        importlib.import_module(f"hetero.cli.{COMMANDS[command][0]}").register(sub)
    else:
        for name, (_, line) in COMMANDS.items():
            sub.add_parser(name, help=line)
    return parser


def add_command(sub: Any, name: str) -> argparse.ArgumentParser:
    """The subparser of command `name`, with its help line from `COMMANDS` (a command module's `register`)."""
    return sub.add_parser(name, help=COMMANDS[name][1])


# command -> (the module of `hetero.cli` that registers it, its help line)
COMMANDS = {
    "run": ("run", "prefill a chat prompt with hetero, then decode the answer"),
    "info": ("run", "show the model, its config and what this machine can run"),
    "calibrate": ("calibrate", "record activation statistics (scales, outliers, importance)"),
    "npu": ("npu", "prepare the NPU graphs (export, compile, cache)"),
    "profile": ("profile", "measure every subgraph kind on the lanes present; write <cache>/profiles/<host>.json"),
    "timeline": ("profile", "render a Gantt chart of a schedule (simulated, or a real run with --real)"),
    "bench": ("bench", "benchmarks (the same runs as bench/*.py)"),
    "serve": ("serve", "serve the model over an OpenAI-compatible HTTP API on 127.0.0.1"),
    "cache": ("cache", "check the user cache ($HETERO_CACHE): verify re-hashes every entry"),
}


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (None: this process's, whose start-up `hetero -v run` then reports)."""
    passive_openmp()  # the edge: before a command module loads torch (hetero/threads.py)
    if argv is None:  # this process is the command: no cyclic GC while it starts (`start_up_done`)
        gc.disable()
    args = build_parser(argv).parse_args(argv)
    if args.command != "run":  # `hetero run` ends its start-up after its prefill
        start_up_done()
    if argv is None:  # the process is this command: its age now is Python's start, the imports and the parser
        from hetero.timing import process_age_s

        args.startup_s = process_age_s()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    quiet_transformers()
    progress.quiet(bool(getattr(args, "json", False)))  # a program reads this command's output: no bars beside it
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


def start_up_done() -> None:
    """End a command process's start-up: the cyclic garbage collector, off since `main` began, runs again, and
    what start-up made (modules, weights, sessions: ~10⁶ objects, which live until exit) is frozen out of its
    scans. A collector running during start-up walked them again and again: 0.4-0.5 s of a warm `hetero run`.
    Does nothing where the collector was left on (`main(argv)` inside another program)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def quiet_transformers() -> None:
    """transformers logs errors only (its warnings about a GGUF's or generate()'s details are not the user's
    business), without importing it (~1 s) when the command does not: the level it reads when it loads."""
    import os

    if "transformers" in sys.modules:
        sys.modules["transformers"].logging.set_verbosity_error()
    else:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _end_process(rc: int) -> None:
    """End this command's process now: its results are printed and its cache files written (atomically), and
    the exit handlers run (logging, temp folders, the decode helper's stop); what is skipped is the teardown of
    every object, ~100 ONNX Runtime sessions, torch's and numba's state: 0.8-0.9 s of a warm `hetero run`,
    for nothing."""
    import atexit
    import os

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
