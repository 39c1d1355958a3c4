"""The out-of-order scheduling policies (mllm-NPU §3.4) against the lower bound and CP-SAT: `bench/sched.py`.

Per profile (this host's measured one, the derived Snapdragon 8 Gen 3 one) and prompt length: simulated
makespan / lower bound per policy, the critical lane's bubble rate, the gap to the CP-SAT optimum where it
solves, and the scheduler's time per decision. Makespans are simulations on the profile, and say so.

    python bench/sched.py --quick                   # fewer prompt lengths, short solver limit
    python bench/sched.py --out bench/results       # the committed sched.{json,md} and timeline PNGs
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/<name>.py`: run as module `bench.<name>`, the checkout on the path
    import pathlib
    import sys
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
    from bench.entry import script
    sys.exit(script(__file__))

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

from bench.entry import out_dir, wrote
from hetero.paths import PROFILES_DIR, atomic_path, cache_dir, profile_search_path
from hetero.sched.costs import compiled_prefill_dag
from hetero.sched.optimal import solve_optimal
from hetero.sched.measure import host_slug
from hetero.sched.profile import Profile, load_profile
from hetero.sched.simulate import simulate
from hetero.sched.timeline import plot_timeline

HELP = "scheduling policies vs the lower bound and CP-SAT, simulated on device profiles"
POLICIES = ("in_order", "chunk_first", "eq6", "rank")
PROMPT_LENS = (64, 256, 1024, 2048, 4096)
DERIVED = PROFILES_DIR / "snapdragon_8gen3_qwen1.5-1.8b.json"


def shown(path: Path) -> str:
    """A profile's path as the results name it: from the checkout, or from `<cache>` (no user's home folder)."""
    path = path.resolve()
    for base, label in ((PROFILES_DIR.parents[1], ""), (cache_dir().resolve(), "<cache>/")):
        if path.is_relative_to(base):
            return label + str(path.relative_to(base))
    return path.name


def host_profile_path() -> Path | None:
    folders = profile_search_path()  # the user's measured profiles first, then the shipped ones
    for own in (d / f"{host_slug()}.json" for d in folders):
        if own.exists():
            return own
    measured = [p for d in folders for p in sorted(d.glob("*.json")) if load_profile(p).method == "measured"]
    return measured[0] if measured else None


def bench_one(profile: Profile, prompt_len: int, chunk_len: int, repeats: int, opt_limit_s: float,
              opt_max_nodes: int) -> tuple[list[dict], dict]:
    dag = compiled_prefill_dag(profile, prompt_len, chunk_len)
    scheds, dec = {}, {}
    for pol in POLICIES:
        runs = [simulate(dag, pol) for _ in range(repeats)]
        scheds[pol] = runs[0]
        dec[pol] = statistics.median(r.decision_us for r in runs)
    lb = dag.lower_bound_us()
    best = min(scheds.values(), key=lambda s: s.makespan_us)
    opt = None
    if best.makespan_us <= lb * (1 + 1e-9):
        opt = {"optimal_us": best.makespan_us, "optimal_proven": True, "optimal_method": "policy reached the lower bound"}
    elif dag.n_nodes <= opt_max_nodes:
        r = solve_optimal(dag, time_limit_s=opt_limit_s, hint=best)
        opt = {"optimal_us": r.makespan_us, "optimal_proven": r.proven, "optimal_bound_us": round(r.bound_us, 3),
               "optimal_method": f"CP-SAT {r.status} in {r.wall_s:.1f} s"}
    rows = []
    for pol, s in scheds.items():
        row = {
            "profile": profile.name, "simulated": True, "profile_method": profile.method,
            "prompt_len": prompt_len, "chunk_len": chunk_len, "n_chunks": dag.n_chunks, "n_nodes": dag.n_nodes,
            "policy": pol, "makespan_us": round(s.makespan_us, 1), "lower_bound_us": round(lb, 1),
            "makespan_over_lb": round(s.makespan_over_lb, 4), "bubble_rate": round(s.bubble_rate, 4),
            "critical_lane": s.critical_lane, "decision_us": round(dec[pol], 3),
            "decision_share": round(dec[pol] * dag.n_nodes / s.makespan_us, 6),
            "reduction_vs_in_order": round(1 - s.makespan_us / scheds["in_order"].makespan_us, 4),
        }
        if opt is not None:
            row.update({k: (round(v, 1) if isinstance(v, float) else v) for k, v in opt.items()})
            row["gap_to_optimal"] = round(s.makespan_us / opt["optimal_us"] - 1, 4)
        rows.append(row)
    return rows, scheds


def markdown(rows: list[dict], conditions: str) -> str:
    out = ["# Scheduler benchmark (simulated on profiles)", "", conditions, "",
           "| profile | prompt | chunks | policy | makespan ms | / LB | bubble | gap to opt | vs in_order | decision µs |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        gap = f"{r['gap_to_optimal']:+.2%}" + ("" if r.get("optimal_proven") else " (best found)") \
            if "gap_to_optimal" in r else "—"
        out.append(f"| {r['profile']} | {r['prompt_len']} | {r['n_chunks']} | {r['policy']} | "
                   f"{r['makespan_us'] / 1e3:.1f} | {r['makespan_over_lb']:.4f} | {r['bubble_rate']:.1%} | {gap} | "
                   f"{0.0 - r['reduction_vs_in_order']:+.1%} | {r['decision_us']:.2f} |")
    return "\n".join(out) + "\n"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    ap.add_argument("--quick", action="store_true", help="prompt lengths 256 and 1024 only, 2 s solver limit")
    ap.add_argument("--chunk", type=int, default=256, help="chunk length C (paper default 256)")
    ap.add_argument("--profile", action="append", type=Path, help="profile JSON (repeatable); default host + derived")
    ap.add_argument("--opt-limit-s", type=float, default=20.0, help="CP-SAT time limit per instance")
    ap.add_argument("--opt-max-nodes", type=int, default=800, help="skip CP-SAT above this many subgraphs")
    ap.add_argument("--out", "--out-dir", dest="out", type=Path, default=None,
                    help="directory for sched.{json,md} and the timelines' PNGs (default: <cache>/bench/; the committed "
                         "results: --out bench/results)")


def run(args: argparse.Namespace) -> int:
    paths = args.profile or [p for p in (host_profile_path(), DERIVED) if p is not None]
    prompt_lens = (256, 1024) if args.quick else PROMPT_LENS
    limit = 2.0 if args.quick else args.opt_limit_s
    out = out_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, pngs = [], []
    for path in paths:
        profile = load_profile(path)
        for n in prompt_lens:
            r, scheds = bench_one(profile, n, args.chunk, 5, limit, args.opt_max_nodes)
            rows += r
            if n == 1024:
                png = out / f"sched_timeline_{profile.name}_1024.png"
                plot_timeline([scheds[p] for p in ("in_order", "eq6", "rank")], png)
                pngs.append(png.name)
            print(f"{profile.name} {n}: " + ", ".join(f"{x['policy']}={x['makespan_over_lb']:.3f}" for x in r),
                  file=sys.stderr)
    conditions = (f"Conditions: chunk length C={args.chunk}; subgraphs per layer from each profile; makespans are "
                  f"discrete-event simulations on the named profile (simulated: true); decision µs measured on "
                  f"{platform.processor() or platform.machine()} with Python {platform.python_version()} "
                  f"(median of 5 runs; other jobs shared the 2 cores); CP-SAT limit {limit} s, up to {args.opt_max_nodes} subgraphs. "
                  f"Profiles: {', '.join(map(shown, paths))}. "
                  f"Timelines: {', '.join(pngs)}.")
    with atomic_path(out / "sched.json") as tmp:
        tmp.write_text(json.dumps(rows, indent=1) + "\n")
    with atomic_path(out / "sched.md") as tmp:
        tmp.write_text(markdown(rows, conditions))
    wrote([out / "sched.json", out / "sched.md", *(out / p for p in pngs)])
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0
