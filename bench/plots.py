"""Plots of the prefill benchmark: speed against prompt length (real | simulated) and the ablation steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hetero.extras import require

# One colour and one readable name per engine, the same in every panel and figure.
ENGINE_STYLE: dict[str, tuple[str, str]] = {
    "hetero": ("tab:red", "hetero (INT8 graphs + shadow, laid out by this host's placement)"),
    "hetero_gqa": ("lightcoral", "hetero with ONNX Runtime's fp32 attention (not its BF16 kernel)"),
    "hetero_lanes": ("darkred", "hetero on two lanes, out-of-order"),
    "hetero_in_order": ("tab:orange", "hetero, in-order dispatch"),
    "hetero_eq6": ("tab:pink", "hetero, Eq. 6 policy"),
    "naive_npu": ("tab:gray", "naive NPU (graphs built per prompt)"),
    "torch_float": ("tab:blue", "torch float (transformers)"),
    "llama_cpp": ("tab:green", "llama.cpp, the GGUF as shipped"),
    "llama_cpp_q4_0": ("limegreen", "llama.cpp Q4_0"),
    "llama_cpp_q4_0_fa": ("darkgreen", "llama.cpp Q4_0, flash attention"),
    "llama_cpp_q8_0": ("yellowgreen", "llama.cpp Q8_0"),
    "llama_cpp_q8_0_fa": ("olivedrab", "llama.cpp Q8_0, flash attention"),
    "openvino_genai": ("tab:cyan", "OpenVINO GenAI, INT8 weights"),
    "openvino_genai_int4": ("darkcyan", "OpenVINO GenAI, INT4 weights (sym, group 64)"),
    "ort_genai": ("navy", "ONNX Runtime GenAI, int4"),
    "chunk_sharing": ("tab:purple", "+ chunk sharing"),
    "chunk_shadow": ("tab:brown", "+ shadow outliers"),
}


def engine_style(engine: str) -> tuple[str, str]:
    """(colour, label) of an engine; unknown engines get a fixed colour from their name."""
    palette = ("tab:olive", "tab:cyan", "black", "gold")
    return ENGINE_STYLE.get(engine, (palette[sum(map(ord, engine)) % len(palette)], engine.replace("_", " ")))


def _error_bar(r: dict[str, Any]) -> tuple[float, float]:
    """(below, above) the median tokens/s: the slowest and the fastest repeat."""
    runs = r.get("runs_ms") or []
    if len(runs) < 2:
        return 0.0, 0.0
    tps = [r["prompt_len"] / (ms / 1e3) for ms in runs]
    return max(0.0, r["tokens_per_s"] - min(tps)), max(0.0, max(tps) - r["tokens_per_s"])


def plot_speed(result: dict[str, Any], path: Path) -> None:
    require("plots", "the benchmark's figures")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, simulated in zip(axes, (False, True)):
        rows = [r for r in result["rows"] if r["simulated"] == simulated]
        for engine in dict.fromkeys(r["engine"] for r in rows):
            pts = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["prompt_len"])
            colour, label = engine_style(engine)
            err = list(zip(*(_error_bar(r) for r in pts)))  # min..max of the repeats around the median
            ax.errorbar([r["prompt_len"] for r in pts], [r["tokens_per_s"] for r in pts], yerr=err, marker="o",
                        capsize=3, color=colour, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("prefill tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        note = rows[0]["note"] if simulated and rows else ""
        ax.set_title(note if simulated else f"real: this machine, {result['conditions']['threads']} threads")
    warn = " (WARNING: loaded machine or noisy repeats, see the table)" if result.get("warnings") else ""
    fig.suptitle(f"Prefill speed, {result['conditions']['model']}: median of {result['conditions']['repeats']}, "
                 f"bars min-max{warn}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ablation(result: dict[str, Any], path: Path) -> None:
    require("plots", "the benchmark's figures")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.engines import ABLATION

    step_engine = dict(ABLATION)  # the same colour for a step as for its engine elsewhere
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key in zip(axes, ("real", "simulated")):
        steps = result["ablation"][key]
        if not steps:
            continue
        ax.bar([s["step"] for s in steps], [s["tokens_per_s"] for s in steps],
               color=[engine_style(s.get("engine") or step_engine.get(s["step"], s["step"]))[0] for s in steps],
               alpha=1.0 if key == "real" else 0.6)
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
