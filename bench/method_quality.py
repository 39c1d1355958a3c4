"""Each method of `hetero.methods` side by side: perplexity and top-1 agreement with float on held-out
text, first-token agreement on chat questions, prefill speed at 1024 tokens (issue 10, deliverable 4).

Perplexity and top-1 run the method's own layer ops (the INT8 ONNX graphs for quantized methods) over
windows of exactly one chunk, so every position's logits come out; first tokens and speed run its full
runtime (chunked, out of order). Speed: median of repeats, beside transformers' float Llama in the same run.
`ppl_prefill`: the perplexity of the runtime's own prefill (its chunks, layout and attention kernel: whole-layer
graphs on two lanes, the BF16 attention kernel where it runs, issue 24), every position's logits from the hidden
rows the prefill leaves, through the float head.
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
import torch

from hetero import model as ref
from bench.questions import QUESTIONS
from hetero.methods import make_runtime
from hetero.prompt import encode_prompt


def chat_ids(tok, question: str) -> torch.Tensor:
    """The question as `hetero run` sends it: through the model's chat template, or raw (with its special tokens)
    when the tokenizer has none (Gemma 3 270M's GGUF)."""
    return torch.tensor(encode_prompt(tok, question))


def _speed(prefill, ids: np.ndarray, repeats: int) -> float:
    prefill(ids)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        prefill(ids)
        times.append(time.perf_counter() - t0)
    return len(ids) / statistics.median(times)


def prefill_logits(rt, ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits of `ids` through `rt`'s own prefill (module doc): [len(ids), vocab]."""
    plan = rt.plan(ids.numpy())
    job, _ = rt.execute(plan, rt.new_cache(plan.ids.size))
    h = np.concatenate([job.h[i][: c.n_valid] for i, c in enumerate(plan.chunks)])
    with torch.inference_mode():
        return ref.logits(rt.model.config, rt.model.weights, torch.from_numpy(h))


def prefill_nll(rt, ids: torch.Tensor) -> float:
    """The summed next-token negative log-likelihood of `ids` through `rt`'s own prefill (module doc)."""
    lg = prefill_logits(rt, ids)
    return -float(torch.log_softmax(lg[:-1].double(), -1).gather(1, ids[1:, None]).sum())


def method_rows(model, methods: list[str], windows: list[torch.Tensor], speed_ids: np.ndarray | None,
                threads: int, repeats: int = 3, log=print) -> list[dict]:
    """One row per method: ppl, Δ vs float, top-1 agreement, chat first-token agreement, tokens/s at 1024."""
    tok = model.tokenizer
    chats = [chat_ids(tok, q) for q in QUESTIONS]
    float_top1 = [ref.forward(model.config, model.weights, ids)[0].argmax(-1) for ids in windows]
    float_first = [int(ref.forward(model.config, model.weights, c)[0][-1].argmax()) for c in chats]
    rows = []
    for method in (["float"] if "float" not in methods else []) + list(methods):  # the Δ column needs float's row
        rt = make_runtime(model, method, chunk=windows[0].numel(), threads=threads)
        qm = rt.model
        nll, nll_prefill, n, agree = 0.0, 0.0, 0, 0
        for ids, top1 in zip(windows, float_top1):
            lg = ref.forward(qm.config, qm.weights, ids, rt.backend)[0]
            nll -= float(torch.log_softmax(lg[:-1].double(), -1).gather(1, ids[1:, None]).sum())
            nll_prefill += prefill_nll(rt, ids)
            n += ids.numel() - 1
            agree += int((lg.argmax(-1) == top1).sum())
        first = sum(int(rt.prefill(c).logits.argmax()) == f for c, f in zip(chats, float_first))
        row = {"method": method, "ppl": math.exp(nll / n), "ppl_prefill": math.exp(nll_prefill / n),
               "top1_agree_pct": 100 * agree / sum(w.numel() for w in windows),
               "first_token_agree": f"{first}/{len(chats)}", "positions": sum(w.numel() for w in windows)}
        attention = getattr(rt.backend, "attention_why", None)
        if attention is not None and rt.layout is not None and rt.layout.mode == "layers":
            row["attention"] = "bf16" if rt.backend.attention is not None else "gqa"
        plan = getattr(rt.backend, "plan", None)
        if plan is not None:
            row.update(weight_form=plan.weight_form, rotated=bool(plan.online),
                       a16_sites=sum(sq.bits == 16 for sq in plan.sites.values()), shadow_sites=len(plan.shadow_sites()),
                       row_scaled_sites=sum(sq.per_row for sq in plan.sites.values()))
            if "validation_ppl" in plan.meta:  # a searched plan: what it measured on its validation split
                row.update(budget_pct=plan.meta["budget_pct"],
                           validation_delta_pct=round(100 * (plan.meta["validation_ppl"] / plan.meta["float_validation_ppl"] - 1), 3))
        rt.close()
        if speed_ids is not None:
            sp = make_runtime(model, method, chunk=256, threads=threads)
            row["prefill_tok_s_1024"] = _speed(lambda x: sp.prefill(x), speed_ids, repeats)
            sp.close()
        log(f"  {method:18s} ppl {row['ppl']:.4f} (prefill {row['ppl_prefill']:.4f}) top1 {row['top1_agree_pct']:.1f}% first {row['first_token_agree']} "
            f"{row.get('prefill_tok_s_1024', 0):.0f} tok/s")
        rows.append(row)
    if speed_ids is not None:
        from bench.engines import ENGINES

        hf = ENGINES["torch_float"](None, threads, len(speed_ids))
        rows.append({"method": "torch_float", "prefill_tok_s_1024": _speed(hf, speed_ids, repeats),
                     "note": "transformers' Llama, float32, same run (speed reference)"})
    f = next(r["ppl"] for r in rows if r["method"] == "float")
    for r in rows:
        if "ppl" in r:
            r["delta_pct"] = 100 * (r["ppl"] / f - 1)
            r["delta_prefill_pct"] = 100 * (r["ppl_prefill"] / f - 1)
    return rows
