"""`hetero bench prefill_parts`: where a prefill's time goes, per subgraph kind and per lane (issue 11).

One runtime of `--method`, the same prompt (held-out text, `harness.prompt_ids`) at each length, two ways:
in program order on the calling thread (every subgraph alone on the cores: the work each kind costs) and
out of order as the method dispatches it (the makespan, each lane's busy time and the critical lane).
The gap between the two totals is what overlapping the lanes buys on this host; the kinds say which
work bounds it (mllm-NPU §3.4: the NPU lane's graphs, or attention on the CPU lane at long prompts).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from hetero.bench.entry import write_json_md
from hetero.arguments import add_method_arg, add_model_arg, int_list, positive_int

HELP = "a prefill's time per subgraph kind (in program order) and per lane (out of order)"


def kind_ms(schedule) -> dict[str, float]:
    """Busy ms of each subgraph kind in one run."""
    dag, out = schedule.dag, defaultdict(float)
    for v in range(dag.n_nodes):
        out[dag.kinds[dag.kind[v]]] += (schedule.end_us[v] - schedule.start_us[v]) / 1e3
    return {k: round(ms, 1) for k, ms in out.items()}


def parts(runtime, serial, ids, repeats: int, threads: int) -> dict[str, Any]:
    """Median run (by total) of each way over `ids`; the serial runtime shares the method's backend and runs
    torch (and the attention kernel, which follows torch's thread count) on `threads` threads (its execution
    plan, which `Runtime.prefill` applies)."""

    def median_run(rt):
        rt.prefill(ids)  # warm-up
        runs = sorted((rt.prefill(ids) for _ in range(repeats)), key=lambda r: r.total_ms)
        return runs[len(runs) // 2]

    alone = median_run(serial)
    ooo = median_run(runtime)
    s = ooo.schedule
    return {"prompt_len": int(ids.numel()), "in_order_ms": round(alone.total_ms, 1), "kinds_ms": kind_ms(alone.schedule),
            "out_of_order_ms": round(ooo.total_ms, 1), "lanes_busy_ms": {k: round(v / 1e3, 1) for k, v in s.busy_us.items()},
            "critical_lane": s.critical_lane, "load": round(os.getloadavg()[0], 2)}


def markdown(r: dict[str, Any]) -> str:
    kinds = list(r["rows"][0]["kinds_ms"]) if r["rows"] else []
    lanes = list(r["rows"][0]["lanes_busy_ms"]) if r["rows"] else []
    lines = [f"# Where a prefill's time goes ({r['model']}, method {r['method']}, {r['threads']} threads)", "",
             f"Reproduce: `{r['command']}`. {r['machine']}. Median of {r['repeats']} runs after a warm-up, per way.",
             "In program order every subgraph runs alone (the work of each kind); out of order is the method's "
             "own dispatch (lane busy times include the slowdown of sharing the cores).", "",
             "| prompt | in order ms | " + " | ".join(kinds) + " | out of order ms | "
             + " | ".join(f"{ln} busy" for ln in lanes) + " | critical | load |",
             "|---:|---:|" + "---:|" * len(kinds) + "---:|" + "---:|" * len(lanes) + "---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['prompt_len']} | {row['in_order_ms']} | "
                     + " | ".join(str(row["kinds_ms"][k]) for k in kinds) + f" | {row['out_of_order_ms']} | "
                     + " | ".join(str(row["lanes_busy_ms"][ln]) for ln in lanes)
                     + f" | {row['critical_lane']} | {row['load']} |")
    return "\n".join(lines) + "\n"


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--lens", default="64,256,1024,2048", help="prompt lengths")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1)
    add_method_arg(p)
    p.add_argument("--out", default=None, help="directory for prefill_parts.json/.md (default: print only)")


def run(args: argparse.Namespace) -> int:
    import platform

    from hetero.bench.harness import prompt_ids
    from hetero.loader import load_model
    from hetero.methods import make_runtime
    from hetero.npu import isa
    from hetero.runtime import Runtime

    lens = int_list(args.lens, "--lens")
    model = load_model(args.model)
    rt = make_runtime(model, args.method, threads=args.threads, weight_form=args.weight_form)
    serial = Runtime(rt.model, chunk=rt.chunk, backend=rt.backend, attention_threads=args.threads)
    ids = prompt_ids(args.model, max(lens))
    try:
        rows = [parts(rt, serial, ids[:n], args.repeats, args.threads) for n in lens]
    finally:
        rt.close()
    isa_flags = ", ".join(isa.machine().get("isa", [])) or "unknown"
    result = {"model": model.name, "method": args.method, "threads": args.threads, "repeats": args.repeats,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {isa_flags}",
              "command": "python bench/prefill_parts.py " + " ".join(sys.argv[1:]), "rows": rows}
    if args.out:
        write_json_md(Path(args.out), "prefill_parts", result, markdown(result))
    print(markdown(result))
    return 0
