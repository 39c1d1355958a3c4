"""Accuracy of the W8A8 + shadow-outlier path against float and the baselines of mllm-NPU Table 5: `bench/accuracy.py`.

Perplexity of the default model on held-out real text (calibration uses a disjoint text), the same windows
for every method; outlier statistics (Fig. 10-11), the importance ranking and pruning sweep (Fig. 12) and
the hot-channel store's memory and hit rate (§3.3). The baselines (smoothquant, llm_int8, per_group) are
fake-quantized in float32; the other rows run the exact INT8 reference. Methods are listed in the result's
notes.

    python bench/accuracy.py [--quick] [--json] --out bench/results     # accuracy.{json,md,png}
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
import math
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from hetero.extras import require
from hetero.loader import load_model
from bench.entry import add_out_arg, out_dir, wrote
from hetero.outliers.corpus import prompt_ids
from bench.method_quality import method_rows
from hetero.methods import use_threads
from hetero.npu import isa
from hetero.outliers.baselines import LLMInt8Backend, PerGroupBackend, SmoothQuantBackend
from hetero.outliers.calibration import ensure_calibration, token_windows
from hetero.outliers.corpus import DEFAULT_EVALUATION, corpus_id, load_corpus
from hetero.outliers.hotstore import HotChannelStore
from hetero.weights import SITES
from hetero.outliers.quantize import ACT_QMAX
from hetero.outliers.search import DEFAULT_BUDGET_PCT, perplexity as search_perplexity
from hetero.outliers.pruning import DEFAULT_PERCENTILE, PlanOptions, plan_from_calibration, rank_sites
from hetero.outliers.shadow import QuantizedBackend
from hetero.paths import atomic_path

METHOD_ROWS = ("float", "hetero", "hetero-shadow", "hetero-gqa", "hetero-w8a8", "hetero-search", "hetero-rot-a16down", "hetero-rot-a16", "hetero-noshadow")
HELP = "perplexity of the quantized paths vs float and Table 5's baselines; outliers, pruning, hot channels"


def perplexity(model, windows, backend=None) -> tuple[float, float]:
    """`outliers.search.perplexity` over the windows, and the seconds it took."""
    t0 = time.perf_counter()
    return search_perplexity(model, windows, backend), time.perf_counter() - t0


def eval_text(path: str | None) -> tuple[str, str]:
    """(name, text) of the evaluation text: the file at `path`, else the shipped held-out text."""
    if path is None:
        return DEFAULT_EVALUATION, load_corpus(DEFAULT_EVALUATION)
    return Path(path).stem, Path(path).read_text()


def method_windows(tokenizer, text: str, n_win: int, window: int) -> list[torch.Tensor]:
    """The windows the methods' rows are scored on: the same tokens as `n_win` windows of `window`, cut into
    windows of one chunk (256) so that every position's logits come out, >= 2,000 positions."""
    n256 = max(8, (n_win * window) // 256)
    return token_windows(tokenizer, text, n256 * 256, 256)[:n256]


def outlier_stats(calib, percentile: float) -> dict:
    """Fig. 10-11 on the calibration text: outlier channels per layer, skew of occurrences."""
    per_layer, top3 = [], []
    for layer in range(calib.n_layers):
        ch, tot = 0, 0
        for site in SITES:
            cnt = calib.sites[(layer, site)].channel_counts(percentile)
            ch += int((cnt > 0).sum())
            tot += cnt.size
            k = max(1, int(math.ceil(0.03 * cnt.size)))
            if cnt.sum() > 0:
                top3.append(float(np.sort(cnt)[::-1][:k].sum() / cnt.sum()))
        per_layer.append({"layer": layer, "outlier_channels": ch, "channels": tot, "pct": 100.0 * ch / tot})
    return {"percentile": percentile, "per_layer": per_layer,
            "mean_outlier_channels_per_layer": float(np.mean([r["outlier_channels"] for r in per_layer])),
            "mean_pct_channels": float(np.mean([r["pct"] for r in per_layer])),
            "top3pct_channels_share_of_occurrences": float(np.median(top3)),
            "top3pct_share_min": float(np.min(top3))}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="2 windows, no extra sweep points (a few minutes)")
    ap.add_argument("--json", action="store_true", help="print the JSON result")
    ap.add_argument("--windows", type=int, default=None, help="evaluation windows of 512 tokens (default 12, quick 2)")
    ap.add_argument("--window", type=int, default=512)
    add_out_arg(ap, "accuracy*.{json,md,png}")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--methods", default=",".join(METHOD_ROWS),
                    help="methods of `hetero methods` compared on their own layer ops, chat and speed ('' = none)")
    ap.add_argument("--text", default=None, help="evaluate on this text file instead of the shipped held-out text")
    ap.add_argument("--no-speed", action="store_true", help="skip the prefill speed at 1024 tokens")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_PCT,
                    help=f"validation perplexity budget (percent) hetero-search is searched for first "
                         f"(default {DEFAULT_BUDGET_PCT}; 0 = use its cached plan)")
    ap.add_argument("--ablations", action="store_true",
                    help="also the reference-plan ablations (7-bit weights, per-tensor weights, p99.5)")
    ap.add_argument("--model", default=None,
                    help="a model name (gemma3-270m), .gguf or HF directory (default: the default model); results "
                         "go to accuracy_<name>.{json,md}")
    ap.add_argument("--methods-only", action="store_true",
                    help="only the methods' rows (no reference plans, Table 5 baselines or pruning sweep)")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # a library setting, not a parameter
    if args.threads:
        use_threads(args.threads)
    n_win = args.windows or (2 if args.quick else 12)
    out = out_dir(args.out)

    model = load_model(args.model)
    calib = ensure_calibration(model, progress=not args.json)
    text_name, text = eval_text(args.text)
    windows = token_windows(model.tokenizer, text, n_win * args.window, args.window)[:n_win]
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    log(f"eval: {len(windows)} windows x {args.window} tokens of {text_name}; calibration {calib.corpus}")

    cfg, w = model.config, model.weights
    rows, store_info = [], {}
    methods = [m for m in args.methods.split(",") if m]
    if methods:
        mwin = method_windows(model.tokenizer, text, n_win, args.window)
        # another model's speed: `bench/prefill.py --model` (its torch reference here is the default model's)
        speed_ids = None if args.no_speed or args.model else prompt_ids(None, 1024)
        if "hetero-search" in methods and args.budget > 0:  # the plan it runs is searched for this budget
            from hetero.methods import METHODS, quant_model, quant_plan

            recipe = METHODS["hetero-search"].recipe
            quant_plan(quant_model(model, recipe), recipe=recipe, budget=args.budget)
        rows += method_rows(model, methods, mwin, speed_ids, args.threads or torch.get_num_threads(), log=log)
    ablations = (("hetero_cpu_int7w", 0.85, "channel", DEFAULT_PERCENTILE, 63),
                 ("shadow_all_w8t", 0.0, "tensor", DEFAULT_PERCENTILE, 127),
                 ("hetero_w8t", 0.85, "tensor", DEFAULT_PERCENTILE, 127),
                 ("shadow_all_p99.5", 0.0, "channel", 99.5, 127),
                 ("hetero_p99.5", 0.85, "channel", 99.5, 127)) if args.ablations else ()

    def measure(method, backend, **extra):
        ppl, sec = perplexity(model, windows, backend)
        rows.append({"method": method, "ppl": ppl, "seconds": round(sec, 1), **extra})
        log(f"  {method:28s} ppl {ppl:9.4f}  ({sec:.0f} s)")
        return ppl

    class CountingBackend(QuantizedBackend):
        """Also records the shadow width (outlier channels) of every 256-token chunk of every kept site."""

        chunk_channels: list[int]

        def shadow_correction(self, layer, site, x):
            sq = self.plan.sites[(layer, site)]
            if sq.shadow:
                for lo in range(0, x.shape[0], 256):
                    self.chunk_channels.append(int((x[lo : lo + 256].abs() > sq.scale * ACT_QMAX).any(0).sum()))
            return super().shadow_correction(layer, site, x)

    def plan_backend(plan, store=False):
        rows_src = HotChannelStore(plan) if store and plan.shadow_sites() else None
        return CountingBackend(cfg, w, plan, rows=rows_src), rows_src

    measure("float_ref", None)
    if args.methods_only:
        return _write(args, out, model, calib, text_name, text, windows, rows, [], {})
    naive = plan_from_calibration(model, calib, PlanOptions(prune_fraction=1.0, pruned_percentile=100.0, method="naive_w8a8"))
    measure("naive_w8a8", QuantizedBackend(cfg, w, naive), scale="absmax", shadow_sites=0)
    clipped = plan_from_calibration(model, calib, PlanOptions(prune_fraction=1.0, pruned_percentile=DEFAULT_PERCENTILE,
                                                              method="clipped_w8a8"))
    measure("clipped_w8a8", QuantizedBackend(cfg, w, clipped), scale=f"p{DEFAULT_PERCENTILE}", shadow_sites=0)
    # w8a8_shadow15: mllm-NPU's plan (the old hetero default) on the exact INT8 torch reference
    for method, frac, wg, pct, qmax in (("shadow_all", 0.0, "channel", DEFAULT_PERCENTILE, 127),
                                        ("w8a8_shadow15", 0.85, "channel", DEFAULT_PERCENTILE, 127), *ablations):
        plan = plan_from_calibration(model, calib, PlanOptions(prune_fraction=frac, method=method, weight_granularity=wg,
                                                               percentile=pct, weight_qmax=qmax))
        be, store = plan_backend(plan, store=True)
        be.stats = {}
        be.chunk_channels = []
        measure(method, be, scale=f"p{pct}", shadow_sites=len(plan.shadow_sites()), prune_fraction=frac,
            weights=f"int{'7' if plan.weight_qmax < 64 else '8'} per {'output channel' if wg == 'channel' else 'tensor'}")
        calls = sum(v[0] for v in be.stats.values())
        chans = sum(v[1] for v in be.stats.values())
        store_info[method] = {"ram_bytes": store.ram_bytes(), "full_copy_bytes": store.full_copy_bytes(),
                              "memory_saved_pct": 100.0 * (1 - store.ram_bytes() / store.full_copy_bytes()),
                              "row_hits": store.stats.hits, "row_misses": store.stats.misses,
                              "hit_rate": store.stats.hit_rate, "shadow_calls": calls,
                              "mean_outlier_channels_per_call": chans / calls if calls else 0.0,
                              "mean_outlier_channels_per_256_chunk_site": float(np.mean(be.chunk_channels))
                              if be.chunk_channels else 0.0, "shadow_sites": len(plan.shadow_sites())}
        rows[-1]["shadow_width_per_256_chunk"] = round(store_info[method]["mean_outlier_channels_per_256_chunk_site"], 1)
    measure("smoothquant", SmoothQuantBackend(cfg, w, calib, alpha=0.5), alpha=0.5)
    measure("llm_int8", LLMInt8Backend(cfg, w, threshold=6.0), threshold=6.0)
    measure("per_group", PerGroupBackend(cfg, w, group=32), group=32)

    by = {r["method"]: r["ppl"] for r in rows if "ppl" in r}
    sweep = [{"prune_fraction": 0.0, "ppl": by["shadow_all"]}, {"prune_fraction": 0.85, "ppl": by["w8a8_shadow15"]}]
    for frac in ((1.0,) if args.quick else (0.5, 0.7, 0.95, 1.0)):  # the default plan at other fractions
        plan = plan_from_calibration(model, calib, PlanOptions(prune_fraction=frac))
        ppl, _ = perplexity(model, windows, QuantizedBackend(cfg, w, plan))
        log(f"  sweep prune {frac:.2f}             ppl {ppl:9.4f}")
        sweep.append({"prune_fraction": frac, "ppl": ppl})
    sweep.sort(key=lambda r: r["prune_fraction"])
    return _write(args, out, model, calib, text_name, text, windows, rows, sweep, store_info)


def _write(args, out: Path, model, calib, text_name: str, text: str, windows, rows: list, sweep: list,
           store_info: dict) -> int:
    """Δ columns, outlier statistics and the ranking; the result files (and stdout)."""
    by = {r["method"]: r["ppl"] for r in rows if "ppl" in r}
    for r in rows + sweep:
        if "ppl" in r and "top1_agree_pct" not in r:  # method rows compare with their own float row
            r["delta_pct"] = 100.0 * (r["ppl"] / by["float_ref"] - 1.0)

    order = rank_sites(calib, DEFAULT_PERCENTILE)
    importance = [{"layer": l, "site": s, "importance": calib.sites[(l, s)].importance(DEFAULT_PERCENTILE),
                   "absmax": calib.sites[(l, s)].absmax, "median_abs": calib.sites[(l, s)].median_abs}
                  for l, s in order]
    result = {
        "model": model.name, "fingerprint": model.fingerprint,
        "eval": {"corpus": corpus_id(text_name, text), "windows": len(windows), "window": args.window,
                 "tokens": int(sum(x.numel() for x in windows))},
        "calibration": {"corpus": calib.corpus, "tokens": calib.n_tokens, "percentile": DEFAULT_PERCENTILE},
        "quick": args.quick, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "isa": isa.machine()["isa"], "loadavg": os.getloadavg(),
        "rows": rows, "prune_sweep": sweep, "hot_channel_store": store_info,
        "outliers": outlier_stats(calib, DEFAULT_PERCENTILE), "importance_ranking": importance,
        "notes": "smoothquant/llm_int8/per_group are fake-quantized in float32 torch; naive/clipped/shadow_all/"
                 "w8a8_shadow15 run the exact INT8 reference on the model as trained (QuantizedBackend). Their plan "
                 "(mllm-NPU's, hetero-w8a8): INT8 weights per output channel "
                 "(static scales folded into the output dequantization; activations per tensor), shadow sites "
                 "s = p99.9/127, pruned sites s = p99.999/127 (clipped), 85% of sites pruned by absmax/s; "
                 "*_w8t = the paper's strict per-tensor INT8 weights; *_p99.5 = shadow sites at s = p99.5/127. "
                 "shadow_width_per_256_chunk = mean outlier channels (width of the CPU float matmul) per 256-token "
                 "chunk per kept site.",
    }
    out.mkdir(parents=True, exist_ok=True)
    stem = (("accuracy_quick" if args.quick else "accuracy") + (f"_{text_name}" if args.text else "")
            + (f"_{Path(args.model).stem}" if args.model else ""))
    with atomic_path(out / f"{stem}.json") as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    with atomic_path(out / f"{stem}.md") as tmp:
        tmp.write_text(to_markdown(result))
    plot(result, out / f"{stem}.png")
    wrote([out / f"{stem}.{ext}" for ext in ("json", "md", "png")])
    if args.json:
        print(json.dumps(result))
    else:
        print(to_markdown(result))
    return 0


def to_markdown(r: dict) -> str:
    lines = [f"# Accuracy: {r['model']} ({'quick' if r['quick'] else 'full'})", "",
             f"Perplexity on {r['eval']['tokens']} tokens of {r['eval']['corpus']} ({r['eval']['windows']} windows of "
             f"{r['eval']['window']}); calibration on {r['calibration']['corpus']} ({r['calibration']['tokens']} tokens), "
             f"scale = p{r['calibration']['percentile']} of |x| / 127.", "",
             ]
    mrows = [row for row in r["rows"] if "top1_agree_pct" in row or row["method"] == "torch_float"]
    if mrows:
        tf = next((row["prefill_tok_s_1024"] for row in mrows if row["method"] == "torch_float"), None)
        lines += [f"Methods (`hetero.methods`) on their own layer ops (INT8 ONNX graphs), {mrows[0].get('positions', 0)} "
                  "positions in windows of 256; first token on 50 chat questions; prefill at 1024 tokens, median, "
                  f"same run (ISA {', '.join(r.get('isa', []))}, loadavg {r.get('loadavg', ['?'])[0]:.1f}: timings noisy). "
                  "`ppl, prefill`: the same windows through the method's own prefill (its layout, chunks and attention "
                  "kernel: `bf16` is hetero's BF16 attention kernel, `gqa` ONNX Runtime's fp32 GroupQueryAttention), "
                  "Δ against float's ppl.",
                  "", "| method | ppl | Δ vs float | ppl, prefill | Δ vs float | attention | top-1 = float | "
                  "first token = float | tokens/s @1024 | vs torch float | plan |",
                  "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"]
        for row in mrows:
            sp = row.get("prefill_tok_s_1024")
            plan = ", ".join(f"{k}={row[k]}" for k in ("weight_form", "rotated", "a16_sites", "shadow_sites", "row_scaled_sites", "budget_pct",
                                                        "validation_delta_pct") if k in row)
            ppl = f"{row['ppl']:.4f} | {row['delta_pct']:+.2f}%" if "ppl" in row else "– | –"
            pre = (f"{row['ppl_prefill']:.4f} | {row['delta_prefill_pct']:+.2f}% | {row.get('attention', '–')}"
                   if "ppl_prefill" in row else "– | – | –")
            top1 = f"{row['top1_agree_pct']:.1f}%" if "top1_agree_pct" in row else "–"
            speed = f"{sp:.0f} | {sp / tf:.2f}x" if sp and tf else "– | –"
            lines.append(f"| {row['method']} | {ppl} | {pre} | {top1} | {row.get('first_token_agree', '–')} | {speed} | {plan} |")
        lines.append("")
    lines += ["Reference plans on the exact INT8 torch reference and Table 5's baselines:", "",
              "| method | ppl | Δ vs float | notes |", "|---|---:|---:|---|"]
    for row in r["rows"]:
        if row in mrows:
            continue
        extra = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("method", "ppl", "delta_pct", "seconds"))
        lines.append(f"| {row['method']} | {row['ppl']:.4f} | {row['delta_pct']:+.2f}% | {extra} |")
    if r["prune_sweep"]:
        lines += ["", "Pruning sweep (Fig. 12 right): share of sites whose shadow is dropped, least important first.",
                  "", "| pruned fraction | ppl | Δ vs float |", "|---:|---:|---:|"]
    for s in r["prune_sweep"]:
        lines.append(f"| {s['prune_fraction']:.2f} | {s['ppl']:.4f} | {s['delta_pct']:+.2f}% |")
    o = r["outliers"]
    lines += ["", f"Outliers (Fig. 10-11, calibration text, |x| > p{o['percentile']}): "
              f"{o['mean_outlier_channels_per_layer']:.1f} outlier channels per layer on average "
              f"({o['mean_pct_channels']:.2f}% of the layer's input channels); the top 3% of channels hold a median "
              f"{100 * o['top3pct_channels_share_of_occurrences']:.1f}% of a site's outlier occurrences "
              f"(min {100 * o['top3pct_share_min']:.1f}%)."]
    for m, s in r["hot_channel_store"].items():
        lines.append(f"Hot-channel store ({m}): {s['ram_bytes'] / 2**20:.2f} MiB of rows in RAM vs "
                     f"{s['full_copy_bytes'] / 2**20:.2f} MiB for a full float copy (-{s['memory_saved_pct']:.1f}%); "
                     f"hit rate on the evaluation text {100 * s['hit_rate']:.1f}% ({s['row_hits']} hits, {s['row_misses']} misses).")
    top = ", ".join(f"{x['layer']}/{x['site']} ({x['importance']:.0f})" for x in r["importance_ranking"][:8])
    lines += ["", f"Most important sites (absmax / s): {top}.", "", r["notes"], ""]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    require("plots", "the accuracy figure")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    rows = [x for x in r["rows"] if "delta_pct" in x]  # not the speed-only reference row
    a = ax[0, 0]
    a.barh([x["method"] for x in rows], [x["delta_pct"] for x in rows], color="tab:blue")  # horizontal: names never overlap
    a.invert_yaxis()
    a.set_xlabel("perplexity Δ vs float (%)")
    a.set_xscale("symlog", linthresh=1.0)
    a.tick_params(axis="y", labelsize=8)
    a.set_title("Table 5 analogue")
    a = ax[0, 1]
    sw = r["prune_sweep"]
    a.plot([s["prune_fraction"] for s in sw], [s["ppl"] for s in sw], "o-")
    a.axhline(next(x["ppl"] for x in rows if x["method"] == "float_ref"), color="gray", ls="--", label="float")
    a.set_xlabel("pruned fraction of sites")
    a.set_ylabel("perplexity")
    a.set_title("Fig. 12 right: accuracy vs pruning")
    a.legend()
    a = ax[1, 0]
    imp = {(x["layer"], x["site"]): x["importance"] for x in r["importance_ranking"]}
    n_layers = 1 + max(l for l, _ in imp)
    for s in SITES:
        a.plot(range(n_layers), [imp[(l, s)] for l in range(n_layers)], "o-", ms=3, label=s)
    a.set_yscale("log")
    a.set_xlabel("layer")
    a.set_ylabel("importance = max|x| / s")
    a.set_title("Fig. 12 left: outlier importance")
    a.legend(fontsize=8)
    a = ax[1, 1]
    pl = r["outliers"]["per_layer"]
    a.bar([p["layer"] for p in pl], [p["pct"] for p in pl])
    a.set_xlabel("layer")
    a.set_ylabel("% of input channels with outliers")
    a.set_title("Fig. 10: outlier channels per layer")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
