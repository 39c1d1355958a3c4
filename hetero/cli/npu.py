"""`hetero npu compile|shapes|layout|cache`: prepare, profile and inspect the NPU graphs; the AI Hub options of
`hetero profile` (`add_hub_profile_args`, `run_hub_profile`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from hetero.cli import add_command
from hetero.arguments import add_model_arg, positive_int
from hetero.errors import ConfigError


def _model(args: argparse.Namespace) -> Any:
    from hetero.loader import load_model

    return load_model(getattr(args, "model", None))


def cmd_compile(args: argparse.Namespace) -> int:
    from hetero.methods import quant_setup

    model, plan = quant_setup(_model(args), "qnn" if args.hub else args.provider)
    if args.hub:
        from hetero.npu.hub import compile_on_hub

        if not args.device:
            raise ConfigError("--hub needs --device NAME (an AI Hub device, e.g. 'Samsung Galaxy S24')")
        graphs = compile_on_hub(model, plan, args.chunk, args.device)
        out = {"device": args.device, "chunk": args.chunk, "graphs": len(graphs),
               "binaries": [str(g.binary) for g in graphs]}
    else:
        from hetero.npu.graph_backend import GraphOptions, NpuBackend
        from hetero.npu.placement import place

        placement = place(model.config, args.budget) if args.budget is not None else None
        be = NpuBackend(model, plan, args.chunk, provider=args.provider,
                        options=GraphOptions(placement=placement, shape=args.shape))
        out = {"provider": be.provider.name, "chunk": args.chunk, "graphs": len(be.report.rows),
               "cached": sum(r[3] for r in be.report.rows), "seconds": round(be.report.seconds, 3),
               "size_bytes": be.report.size_bytes,
               "placement": placement.to_dict() if placement else None}
    print(json.dumps(out, indent=1) if args.json else
          "\n".join(f"{k}: {v}" for k, v in out.items() if k not in ("binaries", "placement")))
    return 0


def cmd_shapes(args: argparse.Namespace) -> int:
    from hetero.methods import quant_setup
    from hetero.npu.providers import make_provider
    from hetero.npu.shapes import profile_shapes

    model, plan = quant_setup(_model(args), args.provider)
    table = profile_shapes(model, plan, args.chunk, make_provider(args.provider), repeats=args.repeats)
    for e in table["entries"]:
        print(f"{e['provider']:8s} {e['kind']:6s} C={e['chunk_len']:4d} winner {e['winner']:6s} {e['latency_us']}")
    return 0


def cmd_layout(args: argparse.Namespace) -> int:
    """Time the default method's prefill in both layouts (`npu.placement`) on this host, interleaved, and record
    the winner that `make_runtime` then uses."""
    import os
    import statistics

    from hetero.outliers.corpus import prompt_ids
    from hetero.methods import DEFAULT_METHOD, make_runtime
    from hetero.npu.placement import LAYOUTS, layout_key, record_layout

    model = _model(args)
    threads = args.threads or os.cpu_count() or 1
    lens = sorted(set(args.lens))
    ids = prompt_ids(getattr(args, "model", None), max(lens) + 64 * args.repeats)
    rts = {mode: make_runtime(model, DEFAULT_METHOD, args.chunk, threads, layout=mode) for mode in LAYOUTS}
    try:
        ms: dict[str, dict[int, list[float]]] = {m: {n: [] for n in lens} for m in LAYOUTS}
        for r in range(args.repeats):  # rounds interleave the layouts, each on a different window of the text
            for n in lens:
                for mode, rt in rts.items():
                    rt.prefill(ids[64 * r: 64 * r + n])  # warm: its graphs, the learned costs of the lanes
                    ms[mode][n].append(rt.prefill(ids[64 * r + 1: 64 * r + 1 + n]).total_ms)
        key = layout_key(rts["layers"].model, args.chunk, threads)
    finally:
        for rt in rts.values():
            rt.close()
    entry = record_layout(key, {m: {n: statistics.median(v) for n, v in t.items()} for m, t in ms.items()})
    for mode in LAYOUTS:
        print(f"{mode:6s} " + "  ".join(f"{n}: {v} ms" for n, v in entry["ms"][mode].items()))
    print(f"winner: {entry['winner']} (recorded for {key}; load average {os.getloadavg()[0]:.1f})")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from hetero.npu.cache import cache_usage, clear_cache, graphs_root

    if args.clear or args.clear_stale:
        freed = clear_cache(only_stale=args.clear_stale)
        print(f"freed {freed / 2**20:.1f} MiB under {graphs_root()}")
    usage = cache_usage()
    if args.json:
        print(json.dumps({"root": str(graphs_root()), "providers": usage}, indent=1))
        return 0
    print(f"graph cache: {graphs_root()}")
    for name, row in usage.items():
        print(f"  {name:14s} {row['entries']:5d} entries  {row['other']:5d} stale/unfinished  {row['bytes'] / 2**20:9.1f} MiB")
    return 0


def register(subparsers: Any) -> None:
    npu = add_command(subparsers, "npu")
    sub = npu.add_subparsers(dest="npu_command", required=True)
    c = sub.add_parser("compile", help="export + compile every static graph into the graph cache")
    add_model_arg(c)
    c.add_argument("--chunk", type=positive_int, default=256)
    c.add_argument("--provider", choices=("cpu", "qnn"), default="qnn", help="ONNX Runtime provider; qnn falls back to cpu if absent")
    c.add_argument("--shape", default="auto",
                   help="'auto' (the equivalent shape recorded by 'npu shapes'), '2d', '3d:a' or 'conv:a'")
    c.add_argument("--budget", type=int, default=None, help="NPU memory budget in bytes (§4)")
    c.add_argument("--hub", action="store_true", help="compile on Qualcomm AI Hub instead")
    c.add_argument("--device", help="AI Hub device name (with --hub)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_compile)
    s = sub.add_parser("shapes", help="profile equivalent shapes and record the winners (§4)")
    add_model_arg(s)
    s.add_argument("--chunk", type=positive_int, nargs="+", default=[256])
    s.add_argument("--provider", choices=("cpu", "qnn"), default="cpu", help="ONNX Runtime provider")
    s.add_argument("--repeats", type=positive_int, default=9, help="timed rounds (interleaved) per candidate")
    s.set_defaults(func=cmd_shapes)
    lay = sub.add_parser("layout", help="time the prefill as whole-layer graphs vs two lanes; record the winner (§4)")
    add_model_arg(lay)
    lay.add_argument("--chunk", type=positive_int, default=256)
    lay.add_argument("--threads", type=positive_int, default=None, help="cores (default: all)")
    lay.add_argument("--lens", type=positive_int, nargs="+", default=[64, 256, 1024], help="prompt lengths")
    lay.add_argument("--repeats", type=positive_int, default=3, help="interleaved rounds")
    lay.set_defaults(func=cmd_layout)
    k = sub.add_parser("cache", help="what the prebuilt-graph cache holds; --clear to empty it")
    g = k.add_mutually_exclusive_group()
    g.add_argument("--clear", action="store_true", help="delete every entry")
    g.add_argument("--clear-stale", action="store_true", help="delete entries of older formats and unfinished builds")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=cmd_cache)


def add_hub_profile_args(p: argparse.ArgumentParser) -> None:
    """Options of `hetero profile` for AI Hub: --hub, --device, --hub-chunks, --hub-out."""
    p.add_argument("--hub", action="store_true", help="profile on a real device through Qualcomm AI Hub")
    p.add_argument("--device", help="AI Hub device name, e.g. 'Samsung Galaxy S24'")
    p.add_argument("--hub-chunks", type=positive_int, nargs="+", default=[128, 256])
    p.add_argument("--hub-out", help="profile JSON to write (default <cache>/profiles/hub-<device>.json)")


def run_hub_profile(args: argparse.Namespace) -> int:
    """`hetero profile --hub --device NAME`: profile jobs → a sched Profile JSON; returns the exit code."""
    from pathlib import Path

    from hetero.methods import quant_setup
    from hetero.npu.hub import _slug, measure_on_hub
    from hetero.paths import user_profiles_dir
    from hetero.sched.profile import save_profile

    if not args.device:
        raise ConfigError("--hub needs --device NAME (an AI Hub device, e.g. 'Samsung Galaxy S24')")
    model, plan = quant_setup(_model(args), "qnn")
    prof = hub_profile(measure_on_hub(model, plan, args.hub_chunks, args.device))
    out = Path(args.hub_out) if args.hub_out else user_profiles_dir() / f"hub-{_slug(args.device)}.json"
    save_profile(prof, out)
    print(f"wrote {out}")
    return 0


def hub_profile(m: Any) -> Any:
    """A measured `hetero.sched.profile.Profile` from a `hetero.npu.hub.HubMeasurement` (lane "npu")."""
    from hetero.sched.profile import CostEntry, Profile

    costs = tuple(CostEntry(kind, "npu", c, ((0, us),)) for (kind, c), us in m.costs_us.items())
    return Profile(name=m.name, method="measured", simulated=False, costs=costs, n_layers=m.n_layers,
                   metadata=m.metadata)
