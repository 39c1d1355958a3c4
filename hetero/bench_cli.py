"""`hetero bench prefill` (registered into the CLI by `hetero.cli`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    from hetero.cli import add_model_arg, positive_int

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("prefill", help="prefill speed, memory, ablation and end-to-end runs against other engines")
    add_model_arg(p)
    add_prefill_args(p, positive_int)
    p.set_defaults(func=cmd_prefill)


def add_prefill_args(p: argparse.ArgumentParser, positive_int: Any) -> None:
    p.add_argument("--lens", default="64,256,1024,2048", help="prompt lengths")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--quick", action="store_true", help="prompt lengths 64,256, one repeat, no end-to-end runs")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end workloads")
    p.add_argument("--out", default="bench/results", help="directory for prefill.json/.md/.png")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def cmd_prefill(args: argparse.Namespace) -> int:
    from hetero.bench_report import run_prefill_bench, write_outputs
    from hetero.errors import ConfigError

    try:
        lens = [int(x) for x in args.lens.split(",")]
    except ValueError:
        raise ConfigError(f"--lens must be comma-separated integers, got {args.lens!r}") from None
    if args.quick:
        lens, args.repeats = [64, 256], 1
    result = run_prefill_bench(lens, args.repeats, args.threads, getattr(args, "model", None),
                               e2e=not (args.quick or args.no_e2e), ablation_len=256 if args.quick else 512)
    paths = write_outputs(result, Path(args.out))
    if args.json:
        print(json.dumps(result))
    else:
        print(paths[1].read_text())
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0
