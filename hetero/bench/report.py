"""The prefill benchmark's outputs: side-by-side ratios, the markdown table, JSON + MD + PNG files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hetero.bench.entry import write_json_md
from hetero.bench.harness import Row
from hetero.bench.plots import plot_ablation, plot_speed


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


def fraction_of_bound(rows: list[Row], bound: dict[str, Any]) -> list[dict[str, Any]]:
    """hetero's tokens/s over the machine's bound (`bench.bound`) per prompt length."""
    ours = {r.prompt_len: r for r in rows if r.engine == "hetero" and not r.simulated}
    return [{"prompt_len": b["prompt_len"], "fraction": round(ours[b["prompt_len"]].tokens_per_s / b["bound_tokens_per_s"], 3)}
            for b in bound["per_len"] if b["prompt_len"] in ours]


def write_outputs(result: dict[str, Any], out_dir: Path, name: str = "prefill") -> list[Path]:
    paths = write_json_md(out_dir, name, result, markdown(result))
    paths += [out_dir / f"{name}_speed.png", out_dir / f"{name}_ablation.png"]
    plot_speed(result, paths[2])
    plot_ablation(result, paths[3])
    return paths


def markdown(result: dict[str, Any]) -> str:
    c = result["conditions"]
    lines = [f"# Prefill benchmark ({c['model']}, {c['threads']} threads, {c['statistic']} of {c['repeats']}, "
             f"C={c['chunk']}, {c['machine']}, {c['date']})", "",
             *([f"**Warning: {w}.**" for w in result.get("warnings", [])] + [""] if result.get("warnings") else []),
             "| engine | prompt | tokens/s | TTFT ms | peak RSS MB | where |", "|---|---:|---:|---:|---:|---|"]
    for r in sorted(result["rows"], key=lambda r: (r["simulated"], r["prompt_len"], -r["tokens_per_s"])):
        where = r["note"] if r["simulated"] else "real, this machine"
        rss = "" if r["simulated"] else f"{r['peak_rss_mb']:.0f}"
        lines.append(f"| {r['engine']} | {r['prompt_len']} | {r['tokens_per_s']:.1f} | {r['ttft_ms']:.1f} | {rss} | {where} |")
    if result["ratios"]:
        lines += ["", "## hetero's speed over each engine (real, same run)", "", "| prompt | vs | × |", "|---:|---|---:|"]
        lines += [f"| {r['prompt_len']} | {r['vs']} | {r['hetero_over']:.2f} |" for r in result["ratios"]]
    if result.get("bound"):
        b = result["bound"]
        frac = {f["prompt_len"]: f["fraction"] for f in b["hetero_fraction"]}
        lines += ["", f"## The machine's bound (same run: u8×s8 GEMM {b['gemm_ops_per_s'] / 1e9:.0f} GOPS, "
                  f"{b['threads']} threads; `hetero.bench.bound`)", "",
                  "| prompt | attention GFLOP/s (torch SDPA / ORT GQA) | bound tokens/s | hetero / bound |",
                  "|---:|---:|---:|---:|"]
        lines += [f"| {p['prompt_len']} | {_rates(p)} | {p['bound_tokens_per_s']:.0f} | "
                  f"{frac.get(p['prompt_len'], float('nan')):.2f} |" for p in b["per_len"]]
    lines += ["", f"Load average (1 min) at the start / end of the engines: {c.get('loadavg_1m_start')} / {c.get('loadavg_1m')}."]
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


def _rates(p: dict) -> str:
    """Attention GFLOP/s of each kernel the bound measured (the faster one sets the bound)."""
    by = p.get("attention_flop_per_s_by_kernel") or {"": p["attention_flop_per_s"]}
    return " / ".join(f"{r / 1e9:.1f}" for r in by.values())
