"""`hetero bench window_layout`: where a sliding-window layer keeps its K/V, measured (issue 25, item 3).

Two layouts of a windowed layer (window W) in the KV cache:
- "mask": every position kept (`KVCache(full_history=True)`), attention masked to the window (ONNX Runtime's
  GroupQueryAttention `local_window_size`, the decode kernel's per-row lower bound);
- "window": only the window kept (`KVCache` default, `KVCache.place`): the layer's rows hold positions base..,
  the last W - 1 positions moved back to row 0 once the rows in use pass W - 1 + max(C, `kv_cache.ROOM`); a
  chunk's attention then sees W - 1 + C keys as its whole past. A ring buffer indexed modulo its size is the
  same memory, but GroupQueryAttention reads the past as one contiguous run of rows, so it could not be bound.

For each model and context: the K/V bytes the cache holds after a prefill of that many tokens, the prefill's
wall time and its last chunk's time (C = 256, float layers: the layout changes only attention and the cache),
and a one-row float decode step's time right after. The model's float weights: Gemma 3 270M (window 512,
15 of 18 layers windowed) and a tiny Mistral built here from transformers' config class (random weights,
window 64 on every layer).

    python bench/window_layout.py                                  # prints a table
    python bench/window_layout.py --out bench/results              # also writes window_layout.{json,md}
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
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetero.arguments import int_list, positive_int
from bench.entry import write_json_md

HELP = "sliding-window layers: memory and time of keeping only the window vs every position with a mask"
LAYOUTS = ("mask", "window")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="2048,4096", help="prompt lengths (default 2048,4096)")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per cell, the median reported (default 3)")
    p.add_argument("--chunk", type=positive_int, default=256, help="prefill chunk C (default 256)")
    p.add_argument("--models", default="gemma3-270m,tiny-mistral",
                   help="comma-separated: gemma3-270m and/or tiny-mistral (default both)")
    p.add_argument("--out", type=Path, default=None, help="write window_layout.{json,md} into this directory")


def tiny_mistral(path: Path, window: int = 64, context: int = 8192):
    """A Mistral of 4 layers, hidden 512, 8 heads of 64, 2 KV heads, window `window` (random weights, saved as an
    HF directory and loaded by hetero's loader)."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from hetero.loader import load_model

    cfg = MistralConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=context,
                        sliding_window=window)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return load_model(path)


def _timed(fn, repeats: int) -> tuple[list[float], list[Any]]:
    """The wall ms and result of each of `repeats` calls."""
    times, outs = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs.append(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return times, outs


def measure(model, name: str, contexts: list[int], chunk: int, repeats: int) -> list[dict[str, Any]]:
    """One row per (context, layout): held K/V bytes, prefill ms, last chunk ms, decode step ms."""
    from hetero.decode.step import DecodeStep
    from hetero.decode.tree import TokenTree
    from hetero.runtime import Runtime

    cfg = model.config
    rt = Runtime(model, chunk=chunk)
    step = DecodeStep(rt)
    rows = []
    g = torch.Generator().manual_seed(0)
    for ctx in contexts:
        ids = torch.randint(3, cfg.vocab, (ctx,), generator=g)
        rt.prefill(ids[:chunk])  # warm-up (first-run allocations, sessions)
        runs: dict[str, list[tuple[float, Any]]] = {layout: [] for layout in LAYOUTS}
        for _ in range(repeats):  # the layouts alternate: a load change on a shared host hits both alike
            for layout in LAYOUTS:
                times, results = _timed(lambda: rt.prefill(ids, rt.new_cache(ctx + 8, full_history=layout == "mask")), 1)
                runs[layout].append((times[0], results[0]))
        tree = TokenTree.chain([int(ids[-1])])
        steps: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        for layout in LAYOUTS:
            step.forward(runs[layout][-1][1].cache, tree)  # warm-up
        for _ in range(max(5, repeats)):
            for layout in LAYOUTS:
                steps[layout] += _timed(lambda: step.forward(runs[layout][-1][1].cache, tree), 1)[0]
        for layout in LAYOUTS:
            res = runs[layout][-1][1]
            # the last chunk: from the end of the one before to its own end (the chunks run in order)
            last = [r.chunk_ms[-1] - r.chunk_ms[-2] for _, r in runs[layout]]
            rows.append({"model": name, "context": ctx, "layout": layout, "windows": sorted(set(cfg.windows)),
                         "windowed_layers": sum(1 for w in cfg.windows if w), "layers": cfg.n_layers,
                         "held_mb": round(res.cache.held_bytes() / 2**20, 2),
                         "prefill_ms": round(statistics.median(t for t, _ in runs[layout]), 1),
                         "last_chunk_ms": round(statistics.median(last), 1),
                         "decode_step_ms": round(statistics.median(steps[layout]), 2),
                         "logits_max_diff": float(np.abs(res.logits - runs["mask"][-1][1].logits).max()),
                         "load": round(os.getloadavg()[0], 2)})
    step.close()
    rt.close()
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = ["# Sliding-window layers: keep only the window, or every position with a mask", "",
             f"Host: {result['host']}; {result['note']}", "",
             "| model | context | layout | K/V held (MiB) | prefill (ms) | last chunk (ms) | decode step (ms) | "
             "max abs logit diff vs mask | load |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['model']} | {r['context']} | {r['layout']} | {r['held_mb']} | {r['prefill_ms']} | "
                     f"{r['last_chunk_ms']} | {r['decode_step_ms']} | {r['logits_max_diff']:.2e} | {r['load']} |")
    lines += ["", result["choice"], ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from bench.host import describe, host
    from hetero.kv_cache import ROOM
    from hetero.loader import load_model

    names = [m.strip() for m in args.models.split(",") if m.strip()]
    args.contexts = int_list(args.contexts, "--contexts")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if name == "gemma3-270m":
                model = load_model("gemma3-270m")
            elif name == "tiny-mistral":
                model = tiny_mistral(Path(tmp) / "tiny-mistral", context=max(args.contexts) + 64)
            else:
                raise SystemExit(f"window_layout: unknown model {name!r} (gemma3-270m, tiny-mistral)")
            rows += measure(model, name, args.contexts, args.chunk, args.repeats)
    pairs = [(a, b) for a, b in zip(rows[::2], rows[1::2])]
    ratios = "; ".join(f"{a['model']} at {a['context']}: {b['held_mb'] / a['held_mb']:.2f}× the memory, last chunk "
                       f"{b['last_chunk_ms'] / a['last_chunk_ms']:.2f}×, decode step {b['decode_step_ms'] / a['decode_step_ms']:.2f}×"
                       for a, b in pairs)
    choice = (f"Window vs mask: {ratios}. The layout kept is the one holding less at no more time: the window "
              f"layout (the `KVCache` default; a windowed layer holds W - 1 + max(C, ROOM = {ROOM}) rows). "
              "GroupQueryAttention computes every score of the past before masking the window, so the mask layout's "
              "chunk time grows with the context; a decode step reads only the window in both. `hetero serve` keeps "
              "every position (full_history): its prefix store can branch at any position.")
    result = {"host": describe(host()), "note": f"C = {args.chunk}, float layers, median of {args.repeats} "
              "(decode: of 5 or more), the layouts alternating; K/V held: the rows the cache wrote; load: the 1-minute load "
              "average after each pair (a shared machine)", "rows": rows, "choice": choice}
    print(markdown(result))
    if args.out is not None:
        write_json_md(args.out, "window_layout", result, markdown(result))
    return 0
