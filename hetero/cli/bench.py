"""`hetero bench <name>`: each benchmark of the checkout's `bench/` as a subcommand, with the arguments of
`bench/<name>.py`. The benchmarks are not part of the installed package: they are found beside an editable
install's `hetero/` (`pip install -e .` from a checkout); elsewhere `hetero bench` says where they are, exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from hetero.cli import add_command

NOT_INSTALLED = ("hetero bench: the benchmarks are not part of the installed package; they live in the bench/ "
                 "folder of a source checkout of hetero: run `python bench/<name>.py` there, or `hetero bench` "
                 "from an editable install of it (pip install -e .)")


def checkout_bench() -> ModuleType | None:
    """`bench.entry` of the checkout this hetero was installed from (editable), else None (a wheel)."""
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "bench" / "entry.py").is_file():
        return None
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    return importlib.import_module("bench.entry")


def not_installed(args: argparse.Namespace) -> int:
    print(NOT_INSTALLED, file=sys.stderr)
    return 2


def register(sub: Any) -> None:
    bench = add_command(sub, "bench")
    entry = checkout_bench()
    if entry is None:
        bench.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        bench.set_defaults(func=not_installed)
        return
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for name in entry.BENCHMARKS:
        module = entry.benchmark(name)
        p = bsub.add_parser(name, help=module.HELP)
        module.add_args(p)
        p.set_defaults(func=module.run)
