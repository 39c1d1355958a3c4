"""`hetero bench decode_step`: one plain decode step's time at given contexts, and where it goes.

A decode step streams every INT8 weight (~106 MB on the default model) and the context's K/V once per token
(issue 13). This times `DecodeStep.forward` for one token (median of `--steps` after a warm-up) and splits a
profiled pass into its parts: the ONNX Runtime graph runs of the layers, the attention kernel
(`decode.rowattn`), the LM head graph, the shadow corrections (mllm-NPU Eq. 1) and the rest (Python, copies).
The parts are shares of the profiled pass applied to the unprofiled median. It also times a step verifying
a chain of each static chunk size (`chunk_costs`), the cost side of the token-tree controller, and the step on
each kernel that runs this model's small steps here (`step_kernels`: hetero's GEMVs, the GGUF's blocks, MatMulNBits).

    python bench/decode_step.py                          # contexts 256, 1024, 2048; prints a table
    python bench/decode_step.py --out bench/results      # also writes decode_step.{json,md}
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/<name>.py`: run as module `bench.<name>`, the checkout on the path
    import pathlib
    import sys
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
    from bench.entry import script
    sys.exit(script(__file__))

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.entry import write_json_md
from bench.host import describe, host
from hetero.arguments import add_method_arg, add_model_arg, int_list, positive_int

HELP = ("one plain decode step's time at given contexts, split into graph runs, attention, head, shadow, rest; "
        "and a step verifying a chain of each static chunk size")
# part -> (file name, function)s whose cumulative time it is; the functions do not call each other
_PARTS = {"graphs": {("bound_step.py", "_run"), ("gemv_step.py", "_linears")},  # the layers' graphs or GEMVs
          "attention": {("rowattn.py", "decode_rows"), ("attnpool.py", "attend")},
          "head": {("head.py", "__call__"), ("gemv_step.py", "__call__")},
          "shadow": {("shadow.py", "shadow_delta_rows")}}


def _timed(step, cache, tree, steps: int) -> tuple[list[float], list[float]]:
    """Wall ms and the calling thread's CPU ms of `steps` one-token steps (CPU time is the step's own work: a
    slower step at equal CPU time was descheduled, a slower one at more CPU time ran slower, e.g. beside another
    process on the other core sharing the caches and the memory bus)."""
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        step.forward(cache, tree)
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.thread_time() - c0) * 1e3)
    return wall, cpu


def step_parts(runtime, ids: list[int], steps: int, threads: int) -> dict[str, Any]:
    """Median ms of a one-token step after a prefill of `ids` on `runtime`, and its parts (ms).

    The step timed is the one a decode runs: the runtime's own (`DecodeStep.of`, which an INT8 runtime has made
    at its first prefill for the prefill's last logits), unless `threads` differs from its `DECODE_THREADS`.
    Its graphs run whole first (a decode's first `SPLIT_AFTER_STEPS` tokens), then split over both cores where
    the step has the helper (`split_ms`: a long decode's)."""
    from hetero.decode.step import DECODE_THREADS, DecodeStep
    from hetero.decode.tree import TokenTree

    cache = runtime.new_cache(len(ids) + 8)
    runtime.prefill(ids, cache)
    step = DecodeStep.of(runtime) if threads == DECODE_THREADS else DecodeStep(runtime, threads=threads,
                                                                                split_after=None)
    split_after, step.split_after = step.split_after, None  # whole graphs until the split below
    try:
        tree = TokenTree.chain([ids[-1]])
        for _ in range(5):  # graph sessions, compiled kernels, first-run allocations
            step.forward(cache, tree)
        times, cpu = _timed(step, cache, tree, steps)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(min(steps, 20)):
            step.forward(cache, tree)
        prof.disable()
        bound = step.prepare(1)
        split_ms = None
        if bound is not None and bound.split():
            step.forward(cache, tree)
            split_ms = round(statistics.median(_timed(step, cache, tree, steps)[0]), 2)
    finally:
        step.split_after = split_after
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, ncalls, own, cumulative, callers)
    total = sum(s[2] for s in stats.values())
    shares = {part: sum(s[3] for (file, _, name), s in stats.items() if (Path(file).name, name) in key) / total
              for part, key in _PARTS.items()}
    shares["rest"] = max(0.0, 1.0 - sum(shares.values()))
    seen = sorted(part for part, key in _PARTS.items()
                  if any((Path(file).name, name) in key and s[1] > 0 for (file, _, name), s in stats.items()))
    ms = statistics.median(times)
    return {"context": len(ids), "step_ms": round(ms, 2), "p10_ms": round(sorted(times)[len(times) // 10], 2),
            "cpu_ms": round(statistics.median(cpu), 2), "split_ms": split_ms,
            "parts_ms": {k: round(v * ms, 2) for k, v in shares.items()}, "profiled": seen,
            "load": round(os.getloadavg()[0], 2)}


def chunk_costs(runtime, ids: list[int], steps: int, threads: int) -> dict[str, Any]:
    """Median ms of a step verifying a chain of c rows (a token tree as one chunk, LLMCad §3.2) after a
    prefill of `ids`, for every static chunk size, and its ratio to a one-row step: what the tree controller
    weighs against the acceptance rate."""
    from hetero.decode.step import TREE_SIZES, DecodeStep
    from hetero.decode.tree import TokenTree

    cache = runtime.new_cache(len(ids) + TREE_SIZES[-1])
    runtime.prefill(ids, cache)
    step = DecodeStep(runtime, threads=threads, split_after=0)
    trees = {c: TokenTree.chain(ids[-c:]) for c in TREE_SIZES}
    for tree in trees.values():
        for _ in range(3):
            step.forward(cache, tree)
    times: dict[int, list[float]] = {c: [] for c in trees}
    for _ in range(steps):  # interleaved, so that a slow stretch of the machine touches every size alike
        for c, tree in trees.items():
            t0 = time.perf_counter()
            step.forward(cache, tree)
            times[c].append((time.perf_counter() - t0) * 1e3)
    ms = {c: statistics.median(t) for c, t in times.items()}
    return {"context": len(ids), "ms": {str(c): round(v, 2) for c, v in ms.items()},
            "ratio": {str(c): round(v / ms[1], 2) for c, v in ms.items()}, "load": round(os.getloadavg()[0], 2)}


def attention_threads(runtime, ids: list[int], steps: int, threads: int) -> dict[str, Any]:
    """Median ms of a one-token step on one thread and on two (`decode.twocore.attnpool`: the KV heads, the graphs' column
    halves (`decode.twocore.halves`) and the INT8 head's halves shared with a helper), interleaved, and whether their
    logits are equal."""
    from hetero.decode.step import DecodeStep
    from hetero.decode.tree import TokenTree

    cache = runtime.new_cache(len(ids) + 8)
    runtime.prefill(ids, cache)
    tree = TokenTree.chain([ids[-1]])
    steps_by = {n: DecodeStep(runtime, threads=threads, attention_threads=n, split_after=0) for n in (1, 2)}
    logits = {n: [step.forward(cache, tree) for _ in range(3)][-1] for n, step in steps_by.items()}
    times: dict[int, list[float]] = {n: [] for n in steps_by}
    for _ in range(steps):
        for n, step in steps_by.items():
            t0 = time.perf_counter()
            step.forward(cache, tree)
            times[n].append((time.perf_counter() - t0) * 1e3)
    ms = {n: statistics.median(t) for n, t in times.items()}
    pool = steps_by[2].pool
    return {"context": len(ids), "one_ms": round(ms[1], 2), "two_ms": round(ms[2], 2),
            "ratio": round(ms[2] / ms[1], 2), "same_logits": bool(np.array_equal(logits[1], logits[2])),
            "helper_heads": pool.helped if pool else 0, "helper_graph_halves": pool.graph_halves if pool else 0,
            "guard_skipped": pool.skipped if pool else 0,
            "steps": steps + 3, "load": round(os.getloadavg()[0], 2)}


def step_kernels(runtime, ids: list[int], steps: int, threads: int) -> dict[str, Any] | None:
    """Median ms of a one-token step on each kernel that runs this model's small steps here (`DecodeStep`'s kernel:
    hetero's GEMVs, the GGUF's blocks, ONNX Runtime's MatMulNBits graphs), interleaved, each with its own head, and
    how far their logits are from the graphs'; None where only the graphs run."""
    from hetero.decode.step import DecodeStep
    from hetero.decode.tree import TokenTree
    from hetero.errors import ConfigError

    cache = runtime.new_cache(len(ids) + 8)
    runtime.prefill(ids, cache)
    tree = TokenTree.chain([ids[-1]])
    steps_by = {}
    for kernel in ("nbits", "gemv", "blocks"):
        try:
            steps_by[kernel] = DecodeStep(runtime, threads=threads, kernel=kernel, split_after=0)
        except ConfigError:  # a kernel this model or CPU does not run
            continue
    if len(steps_by) < 2:
        return None
    logits = {k: [step.forward(cache, tree) for _ in range(3)][-1][0] for k, step in steps_by.items()}
    times: dict[str, list[float]] = {k: [] for k in steps_by}
    for i in range(steps):
        for k, step in (steps_by.items() if i % 2 else reversed(steps_by.items())):
            t0 = time.perf_counter()
            step.forward(cache, tree)
            times[k].append((time.perf_counter() - t0) * 1e3)
    ms = {k: statistics.median(t) for k, t in times.items()}
    ref = logits["nbits"]
    return {"context": len(ids), "ms": {k: round(v, 2) for k, v in ms.items()},
            "speedup_over_nbits": {k: round(ms["nbits"] / v, 3) for k, v in ms.items()},
            "logits_rel_diff_vs_nbits": {k: round(float(np.abs(v - ref).max() / np.abs(ref).max()), 4)
                                         for k, v in logits.items()},
            "same_argmax_as_nbits": {k: bool(v.argmax() == ref.argmax()) for k, v in logits.items()},
            "steps": steps, "load": round(os.getloadavg()[0], 2)}


def markdown(r: dict[str, Any]) -> str:
    parts = list(r["rows"][0]["parts_ms"]) if r["rows"] else []
    lines = [f"# One plain decode step ({r['model']}, method {r['method']}, {r['threads']} decode thread(s))", "",
             f"Reproduce: `{r['command']}`. CPU: {r.get('cpu', '?')}. ISA: {r['isa']}. Parts: shares of a profiled pass applied to the median.",
             "The step is the runtime's own (`DecodeStep.of`); `CPU ms`: its thread's CPU time (median); `split ms`: "
             "the same step once its graphs are split over both cores (a decode past `SPLIT_AFTER_STEPS` tokens).",
             "", "| context | step ms (median) | p10 | CPU ms | " + " | ".join(parts) + " | split ms | load |",
             "|---:|---:|---:|---:|" + "---:|" * len(parts) + "---:|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['context']} | {row['step_ms']} | {row['p10_ms']} | {row.get('cpu_ms', '')} | "
                     + " | ".join(str(row["parts_ms"][p]) for p in parts)
                     + f" | {row.get('split_ms') or '–'} | {row['load']} |")
    if r.get("chunks"):
        sizes = list(r["chunks"][0]["ms"])
        lines += ["", "## A step verifying a chain of C rows (ms, and its ratio to C = 1)", "",
                  "| context | " + " | ".join(f"C = {c}" for c in sizes) + " | load |",
                  "|---:|" + "---:|" * len(sizes) + "---|"]
        for row in r["chunks"]:
            lines.append(f"| {row['context']} | " + " | ".join(f"{row['ms'][c]} ({row['ratio'][c]}×)" for c in sizes)
                         + f" | {row['load']} |")
    if r.get("attention_threads"):
        lines += ["", "## The step on one thread and on two (`decode.twocore.attnpool`: attention, split graphs, head), "
                  "interleaved", "",
                  "| context | one thread ms | two threads ms | ratio | same logits | heads the helper took | "
                  "graph halves the helper ran | steps the contention guard ran on one thread | load |",
                  "|---:|---:|---:|---:|---|---:|---:|---:|---|"]
        for row in r["attention_threads"]:
            lines.append(f"| {row['context']} | {row['one_ms']} | {row['two_ms']} | {row['ratio']}× | "
                         f"{row['same_logits']} | {row['helper_heads']} | {row.get('helper_graph_halves', '')} | "
                         f"{row.get('guard_skipped', 0)} of {row.get('steps', '?')} | {row['load']} |")
    if r.get("kernels"):
        names = list(r["kernels"][0]["ms"])
        lines += ["", "## The step on each kernel that runs it here, interleaved (ms; speed-up over the MatMulNBits "
                  "graphs; logits' max difference from theirs, relative)", "",
                  "| context | " + " | ".join(names) + " | logits vs nbits | load |",
                  "|---:|" + "---:|" * len(names) + "---|---|"]
        for row in r["kernels"]:
            same = {k: "same" if row["same_argmax_as_nbits"][k] else "differs" for k in names}
            lines.append(f"| {row['context']} | " + " | ".join(
                f"{row['ms'][k]} ({row['speedup_over_nbits'][k]}×)" for k in names) + " | " + ", ".join(
                f"{k} {row['logits_rel_diff_vs_nbits'][k]} (argmax {same[k]})" for k in names if k != "nbits")
                + f" | {row['load']} |")
    return "\n".join(lines) + "\n"


def add_args(p: argparse.ArgumentParser) -> None:
    from hetero.decode.step import DECODE_THREADS

    add_model_arg(p)
    p.add_argument("--contexts", default="256,1024,2048", help="context lengths (prompt tokens before the step)")
    p.add_argument("--steps", type=positive_int, default=60, help="timed steps per context")
    add_method_arg(p)
    p.add_argument("--threads", type=positive_int, default=DECODE_THREADS, help="decode step threads")
    p.add_argument("--out", default=None, help="directory for decode_step.json/.md (decode_step_<model>.* with "
                                                 "--model; default: print only)")


def run(args: argparse.Namespace) -> int:
    from hetero.outliers.corpus import prompt_ids
    from hetero.loader import load_model
    from hetero.methods import make_runtime
    from hetero.npu import isa

    contexts = int_list(args.contexts, "--contexts")
    model = load_model(args.model)
    rt = make_runtime(model, args.method, threads=2, weight_form=args.weight_form)
    ids = prompt_ids(args.model, max(contexts)).tolist()
    rows = [step_parts(rt, ids[:c], args.steps, args.threads) for c in contexts]
    chunks = [chunk_costs(rt, ids[:c], max(5, args.steps // 4), args.threads) for c in contexts]
    attn = [attention_threads(rt, ids[:c], args.steps, args.threads) for c in contexts]
    kernels = [k for k in (step_kernels(rt, ids[:c], args.steps, args.threads) for c in contexts) if k is not None]
    result = {"model": model.name, "method": args.method, "threads": args.threads, "chunks": chunks,
              "attention_threads": attn, "kernels": kernels,
              "cpu": describe(host()),
              "isa": {**isa.machine(), "weight_form": isa.resolve_weight_form(args.weight_form)},
              "command": "python bench/decode_step.py " + " ".join(sys.argv[1:]), "rows": rows}
    if args.out:
        write_json_md(Path(args.out), "decode_step" + (f"_{Path(args.model).stem}" if args.model else ""), result,
                      markdown(result))
    print(markdown(result))
    return 0
