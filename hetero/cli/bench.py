"""`hetero bench <name>`: each benchmark of `hetero.bench` as a subcommand, with the arguments of `bench/<name>.py`."""

from __future__ import annotations

from typing import Any

from hetero.bench.entry import BENCHMARKS, benchmark


def register(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks (the same runs as bench/*.py)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for name in BENCHMARKS:
        module = benchmark(name)
        p = bsub.add_parser(name, help=module.HELP)
        module.add_args(p)
        p.set_defaults(func=module.run)
