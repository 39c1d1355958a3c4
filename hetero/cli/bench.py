"""`hetero bench NAME`: each benchmark of `hetero.bench` as a subcommand, with the arguments of `bench/<name>.py`."""

from __future__ import annotations

from typing import Any

from hetero.bench import (accuracy, decode_step, fused_step, graph_cache, htp_accuracy, memory, prefill, prefill_parts,
                          sched)

# name -> module with HELP, add_args(parser), run(args); `bench/<name>.py` runs the same
BENCHMARKS = {"prefill": prefill, "accuracy": accuracy, "sched": sched, "graph_cache": graph_cache,
              "htp_accuracy": htp_accuracy, "memory": memory, "decode_step": decode_step,
              "prefill_parts": prefill_parts, "fused_step": fused_step}


def register(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks (the same runs as bench/*.py)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for name, module in BENCHMARKS.items():
        p = bsub.add_parser(name, help=module.HELP)
        module.add_args(p)
        p.set_defaults(func=module.run)
