"""`hetero bench prefill_parts`: where a prefill's time goes, per subgraph kind and per lane (issue 11).

One runtime of `--method`, the same prompt (held-out text, `corpus.prompt_ids`) at each length, two ways:
in program order on the calling thread (every subgraph alone on the cores: the work each kind costs) and
out of order as the method dispatches it (the makespan, each lane's busy time and the critical lane).
The gap between the two totals is what overlapping the lanes buys on this host; the kinds say which
work bounds it (mllm-NPU §3.4: the NPU lane's graphs, or attention on the CPU lane at long prompts).

    python bench/prefill_parts.py                          # 64, 256, 1024, 2048 tokens; prints a table
    python bench/prefill_parts.py --out bench/results      # also writes prefill_parts.{json,md}
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
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.entry import child_env, write_json_md
from hetero.npu.nodes import WHOLE_LAYER_KINDS
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
    return {"prompt_len": len(ids), "in_order_ms": round(alone.total_ms, 1), "kinds_ms": kind_ms(alone.schedule),
            "out_of_order_ms": round(ooo.total_ms, 1), "lanes_busy_ms": {k: round(v / 1e3, 1) for k, v in s.busy_us.items()},
            "critical_lane": s.critical_lane, "load": round(os.getloadavg()[0], 2)}


def profiled_runs(runtime, ids, lens: list[int]) -> list[dict[str, Any]]:
    """One out-of-order prefill per length on a runtime whose sessions record ONNX Runtime's profile
    (`bench.ort_profile`): per op type, per lane, and inside vs outside ONNX Runtime (Python + torch ops)."""
    import time

    from bench.ort_profile import collect

    windows, results = [], []
    for n in lens:
        runtime.prefill(ids[:n])  # warm-up, outside the window
        t0 = time.time_ns()
        results.append(runtime.prefill(ids[:n]))
        windows.append((t0, time.time_ns()))
    rows = []
    for n, res, prof in zip(lens, results, collect(windows)):
        s = res.schedule
        busy = {k: v / 1e3 for k, v in s.busy_us.items()}
        ms = lambda us: round(us / 1e3, 1)  # noqa: E731
        top = sorted(prof.op_us.items(), key=lambda kv: -kv[1])

        def lane(busy_ms: float, role: str) -> dict[str, Any]:
            return {"busy_ms": round(busy_ms, 1), "ort_run_ms": ms(prof.run_us[role]), "kernels_ms": ms(prof.kernel_us[role]),
                    "runs": prof.runs[role], "outside_ort_ms": round(busy_ms - prof.run_us[role] / 1e3, 1)}

        # whole-layer graphs on every lane (`sched.wavefront`): a layer's session serves both lanes, so the lanes'
        # ORT time is one sum beside their summed busy time
        layers_only = set(s.dag.kinds) <= set(WHOLE_LAYER_KINDS) and len(busy) > 1
        lanes = ({"all lanes": lane(sum(busy.values()), "graphs")} if layers_only
                 else {"npu": lane(busy.get("npu", 0.0), "graphs"), "cpu": lane(busy.get("cpu", 0.0), "attention")})
        rows.append({
            "prompt_len": n, "wall_ms": round(res.total_ms, 1), "lanes_busy_ms": {k: round(v, 1) for k, v in busy.items()},
            "dispatch_ms": round(s.decision_us * s.dag.n_nodes / 1e3, 1), **lanes,
            "ops_ms": {k: ms(v) for k, v in top},
            "parts_ms": {k: ms(v) for k, v in sorted(prof.part_us.items(), key=lambda kv: -kv[1])}})
    return rows


def ops_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The profiled runs' tables: lanes inside / outside ONNX Runtime, then the op types that take the time."""
    lines = ["", "## Inside and outside ONNX Runtime (one profiled out-of-order prefill per length)", "",
             "Busy: the lane's subgraphs from hand-off to completion. ORT run: inside `InferenceSession.run` "
             "(profiled `model_run`); kernels: the sum of its ops. Outside ORT: Python and torch ops (shadow "
             "outliers, RoPE/cache writes) on the lane. Dispatch: the scheduler's decisions on the calling thread.", "",
             "| prompt | wall ms | lane | busy ms | ORT run ms (runs) | kernels ms | outside ORT ms | dispatch ms |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        for lane in [k for k in ("npu", "cpu", "all lanes") if k in r]:
            d = r[lane]
            lines.append(f"| {r['prompt_len']} | {r['wall_ms']} | {lane} | {d['busy_ms']} | {d['ort_run_ms']} ({d['runs']}) | "
                         f"{d['kernels_ms']} | {d['outside_ort_ms']} | {r['dispatch_ms']} |")
    lines += ["", "### Kernel time per op type (ms, both lanes)", ""]
    for r in rows:
        total = sum(r["ops_ms"].values()) or 1.0
        lines.append(f"- {r['prompt_len']} tokens: " + ", ".join(f"{k} {v} ({v / total:.0%})"
                                                             for k, v in list(r["ops_ms"].items())[:10]))
    if any("parts_ms" in r for r in rows):
        lines += ["", "### Kernel time per part of the layer (ms, both lanes; `ort_profile.layer_part`)", "",
                  "An op type mixes parts (a MatMul is a shadow's product or an online Hadamard): the parts follow "
                  "the names the graph builder gives its nodes.", ""]
        for r in rows:
            total = sum(r.get("parts_ms", {}).values()) or 1.0
            lines.append(f"- {r['prompt_len']} tokens: " + ", ".join(f"{k} {v} ({v / total:.0%})"
                                                                 for k, v in r.get("parts_ms", {}).items()))
    return lines


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
    if r.get("profiled"):
        lines += ops_markdown(r["profiled"])
    return "\n".join(lines) + "\n"


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--lens", default="64,256,1024,2048", help="prompt lengths")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1)
    add_method_arg(p)
    p.add_argument("--out", default=None, help="directory for prefill_parts.json/.md (default: print only)")
    p.add_argument("--ops", action="store_true",
                   help="also one ONNX Runtime-profiled prefill per length: time per op type, inside vs outside ORT")
    p.add_argument("--ops-worker", action="store_true", help=argparse.SUPPRESS)  # the profiled process of --ops


def run(args: argparse.Namespace) -> int:
    from hetero.outliers.corpus import prompt_ids
    from bench.host import describe, host
    from hetero.loader import load_model
    from hetero.methods import make_runtime
    from hetero.runtime import Runtime, SerialExecutor

    lens = int_list(args.lens, "--lens")
    model = load_model(args.model)
    rt = make_runtime(model, args.method, threads=args.threads, weight_form=args.weight_form)
    if args.ops_worker:  # this process's sessions record ONNX Runtime's profile ($HETERO_ORT_PROFILE)
        try:
            print(json.dumps(profiled_runs(rt, prompt_ids(args.model, max(lens)), lens)))
        finally:
            rt.close()
        return 0
    serial = Runtime(rt.model, chunk=rt.chunk, backend=rt.backend, attention_threads=args.threads,
                     executor=SerialExecutor(model.config.n_layers, rt.placement))
    ids = prompt_ids(args.model, max(lens))
    try:
        rows = [parts(rt, serial, ids[:n], args.repeats, args.threads) for n in lens]
    finally:
        rt.close()
    profiled = _profiled_process(args) if args.ops else None
    result = {"model": model.name, "method": args.method, "threads": args.threads, "repeats": args.repeats,
              "machine": describe(host()),
              "command": "python bench/prefill_parts.py " + " ".join(sys.argv[1:]), "rows": rows,
              **({"profiled": profiled} if profiled is not None else {})}
    if args.out:
        write_json_md(Path(args.out), "prefill_parts", result, markdown(result))
    print(markdown(result))
    return 0


def _profiled_process(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`profiled_runs` in a process of its own, every session of which records ONNX Runtime's profile (the
    timings of this process stay unprofiled)."""
    import subprocess
    import tempfile

    from hetero.threads import ORT_PROFILE

    cmd = [sys.executable, "-m", "bench.prefill_parts", "--ops-worker", "--lens", args.lens,
           "--threads", str(args.threads), "--method", args.method]
    if args.model:
        cmd += ["--model", args.model]
    if args.weight_form:
        cmd += ["--weight-form", args.weight_form]
    with tempfile.TemporaryDirectory(prefix="hetero-ort-profile-") as tmp:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env({**os.environ, ORT_PROFILE: tmp}))
    if proc.returncode != 0:
        raise RuntimeError(f"the profiled prefill failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
