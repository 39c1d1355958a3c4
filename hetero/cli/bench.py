"""`hetero bench <name>`: each benchmark of `hetero.bench` as a subcommand, with the arguments of `bench/<name>.py`."""

from __future__ import annotations

from typing import Any

from hetero.cli import add_command
from hetero.bench.entry import BENCHMARKS, benchmark


def register(sub: Any) -> None:
    bench = add_command(sub, "bench")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for name in BENCHMARKS:
        module = benchmark(name)
        p = bsub.add_parser(name, help=module.HELP)
        module.add_args(p)
        p.set_defaults(func=module.run)
