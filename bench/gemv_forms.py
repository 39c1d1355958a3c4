"""`hetero bench gemv_forms`: the decode GEMVs' weight forms side by side, as memory bandwidth.

A plain decode step streams every linear's weights once (`native.gemv`); the forms differ in bytes a weight: the INT8
form (8-bit blocks of 128 with float scales, ~1.03) and the GGUF's own blocks (`decode.gguf_blocks`: Q4_1 0.625,
the tied head's Q8_0 1.06). This runs one thread through every layer's four jobs (no attention) and then the head,
in rounds that alternate the forms, and reports ms and GB/s (bytes read / time) per part: how much of a form's
fewer bytes the kernel turns into time. The head is timed right after the layers, so it is not in the cache. Then
plain greedy decode tokens/s of two runtimes in this process, one per form (the decode placement's `small_kernel`),
alternating run by run at each `--contexts` length (`bench/decode.py`'s text and offset): an A/B that a busy machine
slows alike.

    python bench/gemv_forms.py                       # prints a table
    python bench/gemv_forms.py --out bench/results   # also writes gemv_forms.{json,md}
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/<name>.py`: run as module `bench.<name>`, the checkout on the path
    import pathlib
    import sys
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
    from bench.entry import script
    sys.exit(script(__file__))

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.entry import write_json_md
from hetero.arguments import add_model_arg, positive_int

HELP = "the decode GEMVs' weight forms (INT8, the GGUF's own blocks): ms and GB/s of the layers' linears and the head"
FORMS = ("gemv", "blocks")  # `DecodeStep`'s kernels


def _passes(step, head, x: np.ndarray, passes: int) -> tuple[float, float]:
    """Median seconds of the layers' linears and of the head over `passes` passes (each head right after its layers)."""
    jobs = len(step.table.jobs)
    layers, heads = [], []
    for _ in range(passes):
        t0 = time.perf_counter()
        step.table.run(0, jobs, None)
        t1 = time.perf_counter()
        head(x)
        heads.append(time.perf_counter() - t1)
        layers.append(t1 - t0)
    return statistics.median(layers), statistics.median(heads)


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# Decode GEMV weight forms ({r['model']})", "",
             f"Reproduce: `{r['command']}`. One thread, no attention; medians of {r['rounds']} rounds alternating the "
             f"forms, each the median of {r['passes']} passes. Load average {r['load']}.", "",
             "| form | linears MB | linears ms | linears GB/s | head MB | head ms | head GB/s | step's linears + head ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for f, row in r["forms"].items():
        lines.append(f"| {f} | {row['layers_mb']:.1f} | {row['layers_ms']:.3f} | {row['layers_gbs']:.1f} | "
                     f"{row['head_mb']:.1f} | {row['head_ms']:.3f} | {row['head_gbs']:.1f} | "
                     f"{row['layers_ms'] + row['head_ms']:.3f} |")
    if r.get("decode"):
        lines += ["", f"Plain greedy decode, {r['decode'][0]['new']} tokens, tokens/s (median of {r['rounds']} runs "
                  "each, alternating; the ratio is the median of the runs' ratios):", "",
                  "| context | " + " | ".join(FORMS) + " | blocks / gemv | runs |", "|---:|" + "---:|" * (len(FORMS) + 1) + "---|"]
        for d in r["decode"]:
            lines.append(f"| {d['context']} | " + " | ".join(f"{d[f]:.1f}" for f in FORMS) + f" | {d['ratio']:.2f} | "
                         + " / ".join(str(d["runs"][f]) for f in FORMS) + " |")
    return "\n".join(lines) + "\n"


def _decode(model, rt, contexts: list[int], new: int, rounds: int) -> list[dict[str, Any]]:
    """Plain greedy tokens/s of each form at each context: runtimes alike but for the decode placement's kernel."""
    import dataclasses

    from bench.decode import TEXT
    from hetero.decode import SamplingParams, generate
    from hetero.methods import make_runtime, use_threads
    from hetero.native import gemv

    other = make_runtime(model)
    other.host_plan = dataclasses.replace(other.host_plan, decode=dataclasses.replace(
        other.decode, small_kernel="gemv", small_form=gemv.describe()))
    rts = {"blocks": rt, "gemv": other}
    text = model.tokenizer(TEXT.read_text())["input_ids"]
    stop = SamplingParams(max_new_tokens=new, stop_token_ids=())
    out = []
    for n in contexts:
        ids = text[5000 : 5000 + n]
        runs: dict[str, list[float]] = {f: [] for f in FORMS}
        for r in range(rounds + 1):  # the first round warms up
            for f in FORMS:
                p = rts[f].prefill(ids)
                use_threads(1)  # as bench/decode.py's hetero engine
                g = generate(rts[f], p, stop)
                if r:
                    runs[f].append(round(new / (g.decode_ms / 1e3), 1))
        row = {"context": n, "new": new, **{f: statistics.median(runs[f]) for f in FORMS}, "runs": runs,
               "ratio": round(statistics.median(a / b for a, b in zip(runs["blocks"], runs["gemv"])), 2)}
        print(f"context {n}: " + ", ".join(f"{f} {row[f]:.1f}" for f in FORMS) + f" tokens/s, {row['ratio']}x",
              flush=True)
        out.append(row)
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--rounds", type=positive_int, default=7, help="rounds alternating the forms")
    p.add_argument("--passes", type=positive_int, default=20, help="timed passes per form and round")
    p.add_argument("--contexts", default="256,1024,2048", help="plain-decode contexts ('' for none)")
    p.add_argument("--new", type=positive_int, default=32, help="tokens per plain-decode run")
    p.add_argument("--out", default=None, help="directory for gemv_forms.json/.md (default: print only)")


def run(args: argparse.Namespace) -> int:
    from hetero.decode.gemv_step import GemvStep
    from hetero.decode.step import DecodeStep
    from hetero.errors import ConfigError
    from hetero.loader import load_model
    from hetero.methods import make_runtime

    model = load_model(args.model)
    rt = make_runtime(model)
    if rt.decode is None or rt.decode.small_kernel != "blocks":
        raise ConfigError("this model or CPU decodes no GGUF blocks (`hetero info`: decode): nothing to compare")
    rng = np.random.default_rng(0)
    forms = {}
    for kernel in FORMS:
        step = DecodeStep(rt, kernel=kernel, head="auto")
        w = step._gemv_weights()
        g = GemvStep(w, w.arrays, rt.rope, 1, None)
        for buf in (g.h[0], g.a, g.gu):
            buf[...] = rng.standard_normal(buf.shape)
        nbytes = {n: p.w.nbytes + p.ws.nbytes for n, p in w.linears.items()}
        forms[kernel] = (g, step.head, nbytes)
    x = rng.standard_normal((1, model.config.hidden)).astype(np.float32)
    times: dict[str, list[tuple[float, float]]] = {f: [] for f in FORMS}
    for _ in range(args.rounds):
        for f, (g, head, _) in forms.items():
            _passes(g, head, x, 3)  # warm-up
            times[f].append(_passes(g, head, x, args.passes))
    rows = {}
    for f, (_, _, nbytes) in forms.items():
        layers_s = statistics.median(t[0] for t in times[f])
        head_s = statistics.median(t[1] for t in times[f])
        lb, hb = sum(v for n, v in nbytes.items() if n != "head"), nbytes["head"]
        rows[f] = {"layers_mb": lb / 1e6, "layers_ms": layers_s * 1e3, "layers_gbs": lb / layers_s / 1e9,
                   "head_mb": hb / 1e6, "head_ms": head_s * 1e3, "head_gbs": hb / head_s / 1e9}
        print(f"{f}: linears {rows[f]['layers_ms']:.3f} ms ({rows[f]['layers_gbs']:.1f} GB/s), "
              f"head {rows[f]['head_ms']:.3f} ms ({rows[f]['head_gbs']:.1f} GB/s)", flush=True)
    decode = _decode(model, rt, [int(c) for c in args.contexts.split(",") if c.strip()], args.new, args.rounds)
    result = {"model": model.name, "forms": rows, "rounds": args.rounds, "passes": args.passes, "decode": decode,
              "load": round(os.getloadavg()[0], 2), "command": "python bench/gemv_forms.py " + " ".join(sys.argv[1:])}
    if args.out:
        write_json_md(Path(args.out), "gemv_forms", result, markdown(result))
    print(markdown(result))
    return 0
