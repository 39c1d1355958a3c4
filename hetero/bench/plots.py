"""Plots of the prefill benchmark: speed against prompt length (real | simulated) and the ablation steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_speed(result: dict[str, Any], path: Path) -> None:
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
