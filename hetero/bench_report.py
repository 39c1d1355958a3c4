"""`hetero bench prefill`: run the engines side by side, then write the JSON, the markdown table and plots.

Real rows are measured on this machine; simulated rows come from a device profile and say so.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hetero.benchmark import ABLATION, Row, run_e2e, run_engines, simulated_ablation, simulated_rows
from hetero.extras import require

REAL_ENGINES = ("hetero", "hetero_in_order", "naive_npu", "torch_float", "llama_cpp")


def run_prefill_bench(lens: list[int], repeats: int, threads: int, model_path: str | None = None,
                      engines: tuple[str, ...] = REAL_ENGINES, ablation_len: int = 512, e2e: bool = True,
                      profile_path: str | None = None, progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    bar = tqdm(total=len(engines) + len(ABLATION) + 2, desc="hetero bench", disable=not progress)

    def step(name: str) -> None:
        bar.set_postfix_str(name)
        bar.update(1)

    rows, skipped = run_engines(list(engines), lens, repeats, threads, model_path, progress=step)
    ablation_engines = [e for _, e in ABLATION]
    ab_rows, ab_skipped = run_engines(ablation_engines, [ablation_len], repeats, threads, model_path, progress=step)
    by_engine = {r.engine: r for r in ab_rows}
    ablation_real = [{"step": label, "engine": e, "prompt_len": ablation_len, "prefill_ms": by_engine[e].ttft_ms,
                      "tokens_per_s": by_engine[e].tokens_per_s, "simulated": False}
                     for label, e in ABLATION if e in by_engine]
    sim = simulated_rows(profile_path, lens)
    ablation_sim = simulated_ablation(profile_path, ablation_len)
    step("simulated")
    e2e_rows = run_e2e(model_path, threads) if e2e else []
    step("end-to-end")
    bar.close()
    return {
        "conditions": {"model": model_path or "SmolLM2-135M-Instruct (Q4_1 GGUF, default)", "threads": threads,
                       "repeats": repeats, "statistic": "median after 1 warm-up", "chunk": 256,
                       "machine": f"{platform.processor() or platform.machine()}, {_cpus()} CPUs",
                       "date": datetime.now(timezone.utc).isoformat(timespec="seconds")},
        "rows": [asdict(r) for r in rows + sim],
        "ratios": ratios(rows),
        "ablation": {"real": ablation_real, "simulated": ablation_sim},
        "e2e": e2e_rows,
        "skipped": {**skipped, **ab_skipped},
    }


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """hetero's tokens/s over each other engine's, per prompt length (side by side, same run)."""
    idx = {(r.engine, r.prompt_len): r for r in rows if not r.simulated}
    out = []
    for (engine, n), r in sorted(idx.items(), key=lambda x: (x[0][1], x[0][0])):
        ours = idx.get(("hetero", n))
        if ours is None or engine == "hetero":
            continue
        out.append({"prompt_len": n, "vs": engine, "hetero_over": round(ours.tokens_per_s / r.tokens_per_s, 3)})
    return out


def write_outputs(result: dict[str, Any], out_dir: Path, name: str = "prefill") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md", out_dir / f"{name}_speed.png", out_dir / f"{name}_ablation.png"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(markdown(result))
    plot_speed(result, paths[2])
    plot_ablation(result, paths[3])
    return paths


def markdown(result: dict[str, Any]) -> str:
    c = result["conditions"]
    lines = [f"# Prefill benchmark ({c['model']}, {c['threads']} threads, {c['statistic']} of {c['repeats']}, "
             f"C={c['chunk']}, {c['machine']}, {c['date']})", "",
             "| engine | prompt | tokens/s | TTFT ms | peak RSS MB | where |", "|---|---:|---:|---:|---:|---|"]
    for r in sorted(result["rows"], key=lambda r: (r["simulated"], r["prompt_len"], -r["tokens_per_s"])):
        where = r["note"] if r["simulated"] else "real, this machine"
        rss = "" if r["simulated"] else f"{r['peak_rss_mb']:.0f}"
        lines.append(f"| {r['engine']} | {r['prompt_len']} | {r['tokens_per_s']:.1f} | {r['ttft_ms']:.1f} | {rss} | {where} |")
    if result["ratios"]:
        lines += ["", "## hetero's speed over each engine (real, same run)", "", "| prompt | vs | × |", "|---:|---|---:|"]
        lines += [f"| {r['prompt_len']} | {r['vs']} | {r['hetero_over']:.2f} |" for r in result["ratios"]]
    lines += ["", "## Ablation (mllm-NPU Fig. 17 steps)", "", "| step | real ms | real tokens/s | simulated ms | simulated tokens/s |",
              "|---|---:|---:|---:|---:|"]
    real = {a["step"]: a for a in result["ablation"]["real"]}
    for a in result["ablation"]["simulated"]:
        r = real.get(a["step"], {})
        lines.append(f"| {a['step']} | {r.get('prefill_ms', '—')} | {r.get('tokens_per_s', '—')} | {a['prefill_ms']} | {a['tokens_per_s']} |")
    if result["ablation"]["simulated"]:
        lines.append(f"\nSimulated: profile {result['ablation']['simulated'][0]['profile']} (derived from the paper), "
                     f"prompt {result['ablation']['simulated'][0]['prompt_len']} tokens.")
    if result["e2e"]:
        lines += ["", "## End to end: prefill + 32 decoded tokens (real)", "",
                  "| workload | engine | prompt | prefill ms | decode ms | total ms | answer |", "|---|---|---:|---:|---:|---:|---|"]
        for e in result["e2e"]:
            if "skipped" in e:
                lines.append(f"| {e['workload']} | {e['engine']} | skipped: {e['skipped']} | | | | |")
                continue
            ans = e["answer"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {e['workload']} | {e['engine']} | {e['prompt_len']} | {e['prefill_ms']} | {e['decode_ms']} | "
                         f"{e['total_ms']} | {ans} |")
    if result["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in result["skipped"].items())]
    return "\n".join(lines) + "\n"


def plot_speed(result: dict[str, Any], path: Path) -> None:
    require("plots", "the benchmark's figures")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, simulated in zip(axes, (False, True)):
        rows = [r for r in result["rows"] if r["simulated"] == simulated]
        for engine in dict.fromkeys(r["engine"] for r in rows):
            pts = sorted((r["prompt_len"], r["tokens_per_s"]) for r in rows if r["engine"] == engine)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=engine)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("prefill tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        note = rows[0]["note"] if simulated and rows else ""
        ax.set_title(note if simulated else f"real: this machine, {result['conditions']['threads']} threads")
    fig.suptitle(f"Prefill speed, {result['conditions']['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ablation(result: dict[str, Any], path: Path) -> None:
    require("plots", "the benchmark's figures")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key in zip(axes, ("real", "simulated")):
        steps = result["ablation"][key]
        if not steps:
            continue
        ax.bar([s["step"] for s in steps], [s["tokens_per_s"] for s in steps], color="tab:blue" if key == "real" else "tab:gray")
        for i, s in enumerate(steps):
            ax.text(i, s["tokens_per_s"], f"{s['tokens_per_s']:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("prefill tokens/s")
        title = "real: this machine" if key == "real" else f"simulated, profile {steps[0]['profile']}"
        ax.set_title(f"{title}, {steps[0]['prompt_len']} tokens")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("Ablation (mllm-NPU Fig. 17 steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
