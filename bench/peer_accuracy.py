"""Each engine's accuracy beside its speed: perplexity and top-1 agreement with hetero's float reference on the
held-out windows of `bench/accuracy.py` (its methods' windows: the same tokens, windows of one 256-token chunk),
every engine through its own API, and its prefill tokens/s at 1024 tokens measured in the same run.

    python bench/peer_accuracy.py [--text FILE] [--engines hetero,openvino_genai,...] [--shared] --out bench/results
        # peer_accuracy.{json,md,png}

- `hetero_float`: hetero's float reference (`hetero.model.forward`), the row every Δ and agreement is against;
- `hetero`: the default method through its own prefill (`method_quality.prefill_logits`: the column
  `bench/accuracy.py` calls "ppl, prefill");
- each peer of `bench.peer_engines.PEERS` in a process of its own (`open_logits`): llama.cpp with logits_all,
  the OpenVINO IR through openvino.Core, ONNX Runtime GenAI's logits output; a peer that cannot run is skipped,
  with the reason in the results.
Speed: `bench.harness.run_engines` at 1024 tokens, median of `--repeats` after a warm-up, each engine in a process
of its own, rounds interleaved. On a machine others use, run it under `flock /tmp/hetero-bench.lock` and say so
with `--shared`. The frontier: the engines no other engine beats on both speed and Δ perplexity.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/<name>.py`: run as module `bench.<name>`, the checkout on the path
    import pathlib
    import sys
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
    from bench.entry import script
    sys.exit(script(__file__))

import argparse
import math
import sys
from collections.abc import Iterable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.entry import add_out_arg, out_dir, wrote, write_json_md
from bench.peer_engines import LABELS, PEERS
from hetero.arguments import add_model_arg, positive_int
from hetero.errors import ConfigError
from hetero.extras import require
from hetero.paths import atomic_path

HELP = "each engine's perplexity and top-1 agreement with float beside its prefill speed at 1024 tokens"

REFERENCE = "hetero_float"
ENGINES = (REFERENCE, "hetero", *PEERS)
SPEED_LEN = 1024
HOW = {REFERENCE: "hetero's float32 layer ops (`hetero.model.forward`)",
       "hetero": "its own prefill (chunks, layout, BF16 attention kernel), every row through the float head",
       "openvino_genai": "the exported IR through `openvino.Core` (CPU plugin defaults, as GenAI compiles it)",
       "openvino_genai_int4": "the exported IR through `openvino.Core` (CPU plugin defaults, as GenAI compiles it)",
       "ort_genai": "the generator's `logits` output of the prompt's step",
       **{p: "`Llama(logits_all=True)`, `scores` after `eval`" for p in PEERS if p.startswith("llama_cpp")}}
ENGINE_LABELS = {REFERENCE: "hetero, float reference",
                 "hetero": "hetero, default method (INT8 graphs + shadow outliers)", **LABELS}


def dominated_by(points: dict[str, tuple[float, float]]) -> dict[str, list[str]]:
    """engine -> the engines that beat it on both axes: at least as fast and at least as accurate, and better on
    one (points: engine -> (tokens/s, Δ perplexity %), lower Δ is better); [] = on the frontier."""
    return {e: [o for o, (t2, d2) in points.items() if o != e and t2 >= t and d2 <= d and (t2 > t or d2 < d)]
            for e, (t, d) in points.items()}


def score_windows(scores: Iterable[tuple[float, list[int]]], float_top1: list[list[int]]) -> dict[str, float]:
    """Perplexity and top-1 agreement (% of every position's argmax equal to float's) from the windows'
    (`peer_engines.window_score`) scores, in window order."""
    nll, n, agree, total = 0.0, 0, 0, 0
    for (w_nll, top1), ref in zip(scores, float_top1, strict=True):
        if len(top1) != len(ref):
            raise ConfigError(f"an engine scored {len(top1)} positions of a window of {len(ref)}")
        nll += w_nll
        n += len(ref) - 1
        agree += sum(a == b for a, b in zip(top1, ref))
        total += len(ref)
    return {"ppl": math.exp(nll / n), "top1_agree_pct": 100.0 * agree / total}


def _hetero_scores(model, engine: str, windows, threads: int) -> list[tuple[float, list[int]]]:
    """The windows' scores of hetero's float reference or default method, in this process."""
    from hetero import model as ref
    from bench.method_quality import prefill_logits
    from bench.peer_engines import window_score
    from hetero.methods import make_runtime

    if engine == REFERENCE:
        return [window_score(ref.forward(model.config, model.weights, ids)[0].numpy(), ids.tolist()) for ids in windows]
    rt = make_runtime(model, engine, chunk=windows[0].numel(), threads=threads)
    try:
        return [window_score(prefill_logits(rt, ids).numpy(), ids.tolist()) for ids in windows]
    finally:
        rt.close()


def _peer_scores(engine: str, model_path: str | None, windows, threads: int) -> list[tuple[float, list[int]]]:
    """The windows' scores of a peer, through its own API in a process of its own."""
    from bench.peer_engines import PeerProcess

    proc = PeerProcess(engine, threads, max(w.numel() for w in windows), model_path, logits=True)
    try:
        return [proc.score(ids.tolist()) for ids in windows]
    finally:
        proc.close()


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--text", default=None, help="evaluate on this text file instead of the shipped held-out text")
    p.add_argument("--windows", type=positive_int, default=12,
                   help="the tokens of this many windows of --window, as `bench/accuracy.py` (default 12)")
    p.add_argument("--window", type=positive_int, default=512)
    p.add_argument("--engines", default=",".join(ENGINES[1:]),
                   help=f"engines beside the float reference (of {', '.join(ENGINES[1:])})")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed prefills at 1024 tokens per engine")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--no-speed", action="store_true", help="accuracy only (no tokens/s column, no plot)")
    p.add_argument("--shared", action="store_true",
                   help="the machine was shared with other work while this ran: the results say so beside the speed")
    add_out_arg(p, "peer_accuracy*.{json,md,png}")


def run(args: argparse.Namespace) -> int:
    from bench.accuracy import eval_text, method_windows
    from bench.conditions import load_avg, trust_warnings
    from bench.harness import run_engines
    from bench.host import describe, host
    from bench.workers import EngineUnavailable
    from hetero.loader import load_model
    from hetero.methods import use_threads
    from hetero.outliers.corpus import corpus_id

    engines = [e.strip() for e in args.engines.split(",") if e.strip() and e.strip() != REFERENCE]
    if any(e not in ENGINES for e in engines):
        raise ConfigError(f"--engines must name engines of {', '.join(ENGINES[1:])}, got {args.engines!r}")
    engines = [REFERENCE, *dict.fromkeys(engines)]
    use_threads(args.threads)
    model = load_model(args.model)
    text_name, text = eval_text(args.text)
    windows = method_windows(model.tokenizer, text, args.windows, args.window)
    load_before = load_avg()
    scores: dict[str, list[tuple[float, list[int]]]] = {}
    skipped: dict[str, str] = {}
    for engine in engines:
        print(f"peer_accuracy: scoring {engine}", file=sys.stderr, flush=True)
        if engine not in PEERS:
            scores[engine] = _hetero_scores(model, engine, windows, args.threads)
            continue
        try:
            scores[engine] = _peer_scores(engine, args.model, windows, args.threads)
        except (EngineUnavailable, RuntimeError) as e:  # not installed, or its process failed: said in the results
            skipped[engine] = str(e)
    float_top1 = [top1 for _, top1 in scores[REFERENCE]]
    rows = [{"engine": e, "label": ENGINE_LABELS[e], "logits": HOW[e], **score_windows(scores[e], float_top1)}
            for e in engines if e in scores]
    for r in rows:
        r["delta_ppl_pct"] = 100.0 * (r["ppl"] / rows[0]["ppl"] - 1.0)
    speed_rows = []
    if not args.no_speed:
        print(f"peer_accuracy: prefill speed at {SPEED_LEN} tokens", file=sys.stderr, flush=True)
        speed_rows, speed_skipped = run_engines([r["engine"] for r in rows], [SPEED_LEN], args.repeats, args.threads,
                                                args.model)
        skipped.update({e: f"speed: {why}" for e, why in speed_skipped.items()})
        by = {s.engine: s for s in speed_rows}
        for r in rows:
            if r["engine"] in by:
                s = by[r["engine"]]
                r.update(tokens_per_s=s.tokens_per_s, runs_ms=s.runs_ms, peak_rss_mb=s.peak_rss_mb)
    timed = {r["engine"]: (r["tokens_per_s"], r["delta_ppl_pct"]) for r in rows if "tokens_per_s" in r}
    beaten = dominated_by(timed)
    for r in rows:
        if r["engine"] in beaten:
            r["dominated_by"] = beaten[r["engine"]]
    h = host()
    result = {
        "conditions": {"model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, default)", "threads": args.threads,
                       "speed": None if args.no_speed else f"prefill of {SPEED_LEN} tokens, median of {args.repeats} "
                                "after 1 warm-up, each engine in its own process, rounds interleaved, same run",
                       "repeats": args.repeats,
                       "shared_machine": args.shared, "machine": describe(h), "host": h,
                       "loadavg_1m_start": round(load_before, 2), "loadavg_1m": round(load_avg(), 2),
                       "date": datetime.now(timezone.utc).isoformat(timespec="seconds")},
        "eval": {"corpus": corpus_id(text_name, text), "windows": len(windows), "window": int(windows[0].numel()),
                 "positions": int(sum(w.numel() for w in windows))},
        "warnings": [] if args.no_speed else trust_warnings([asdict(s) for s in speed_rows], load_before, load_avg()),
        "rows": rows,
        "frontier": [e for e, by_ in beaten.items() if not by_],
        "skipped": skipped,
    }
    stem = "peer_accuracy" + (f"_{text_name}" if args.text else "") + (
        f"_{Path(args.model).stem}" if args.model else "")
    out = out_dir(args.out)
    paths = write_json_md(out, stem, result, markdown(result))
    if timed:
        paths.append(out / f"{stem}.png")
        plot(result, paths[-1])
    print(paths[1].read_text())
    wrote(paths)
    return 0


def frontier_sentence(result: dict[str, Any]) -> str:
    """Which engines lie on the frontier, and whether hetero's default does (or what beats it)."""
    rows = {r["engine"]: r for r in result["rows"] if "dominated_by" in r}
    if not rows:
        return "No engine was timed: no frontier."
    on = ", ".join(f"`{e}`" for e in result["frontier"])
    h = rows.get("hetero")
    if h is None:
        verdict = "hetero's default was not timed."
    elif not h["dominated_by"]:
        verdict = "hetero's default lies on it: no engine is both faster and more accurate."
    else:
        verdict = ("hetero's default does not: " + ", ".join(f"`{e}`" for e in h["dominated_by"])
                   + " is both at least as fast and at least as accurate.")
    return f"On the frontier (no engine both faster and more accurate, at {SPEED_LEN} tokens): {on}. {verdict}"


def markdown(result: dict[str, Any]) -> str:
    c, ev = result["conditions"], result["eval"]
    lines = [f"# Each engine's accuracy beside its speed ({c['model']}, {c['threads']} threads, {c['machine']}, "
             f"{c['date']})", "",
             f"Perplexity and top-1 agreement with hetero's float reference on {ev['positions']} positions of "
             f"{ev['corpus']} ({ev['windows']} windows of {ev['window']}: `bench/accuracy.py`'s windows), each engine "
             f"through its own API; tokens/s: {c['speed'] or 'not measured'}. Δ: perplexity over the float "
             "reference's.", ""]
    if c.get("shared_machine") and c.get("speed"):
        lines += ["**The speed column was measured on a machine shared with other work** (1-minute load average "
                  f"{c['loadavg_1m_start']} at the start, {c['loadavg_1m']} at the end): the engines' ratios within "
                  "this run hold better than their absolute tokens/s.", ""]
    lines += [f"**Warning: {w}.**" for w in result.get("warnings", [])] + ([""] if result.get("warnings") else [])
    lines += [f"| engine | tokens/s @{SPEED_LEN} | perplexity | Δ vs float | top-1 = float | beaten on both by |",
              "|---|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        tps = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "–"
        beaten = ("–" if "dominated_by" not in r else ", ".join(r["dominated_by"]) or "none: on the frontier")
        lines.append(f"| {r['engine']} | {tps} | {r['ppl']:.4f} | {r['delta_ppl_pct']:+.2f}% | "
                     f"{r['top1_agree_pct']:.1f}% | {beaten} |")
    lines += ["", frontier_sentence(result), "", "Engines, and how each one's logits were read:", ""]
    lines += [f"- `{r['engine']}`: {r['label']}; {r['logits']}." for r in result["rows"]]
    if result["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in result["skipped"].items())]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """tokens/s at 1024 against Δ perplexity, one point per engine, the frontier joined."""
    require("plots", "the speed-accuracy figure")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import engine_style

    rows = [r for r in result["rows"] if "tokens_per_s" in r]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in rows:
        colour, _ = engine_style(r["engine"])
        ax.scatter(r["delta_ppl_pct"], r["tokens_per_s"], color=colour, s=60, zorder=3,
                   marker="*" if r["engine"] == "hetero" else "o")
        ax.annotate(r["engine"], (r["delta_ppl_pct"], r["tokens_per_s"]), textcoords="offset points", xytext=(6, 4),
                    fontsize=8)
    front = sorted((r for r in rows if not r["dominated_by"]), key=lambda r: r["delta_ppl_pct"])
    ax.plot([r["delta_ppl_pct"] for r in front], [r["tokens_per_s"] for r in front], color="gray", ls="--",
            zorder=2, label="frontier")
    ax.set_xscale("symlog", linthresh=1.0)  # hetero's tenths of a percent beside 4-bit peers' several percent
    ax.set_xlabel("perplexity Δ vs float (%)")
    ax.set_ylabel(f"prefill tokens/s at {SPEED_LEN}")
    c = result["conditions"]
    ax.set_title(f"Speed against accuracy ({c['machine']}{', shared machine' if c.get('shared_machine') else ''})",
                 fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
