"""The prefill benchmark's outputs: side-by-side ratios, the markdown table, JSON + MD + PNG files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.entry import write_json_md
from bench.harness import Row
from bench.plots import plot_ablation, plot_speed


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


def vs_best_peer(rows: list[Row], peers: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per prompt length: the fastest peer's row in this run and hetero's tokens/s over it."""
    real = [r for r in rows if not r.simulated]
    out = []
    for n in sorted({r.prompt_len for r in real}):
        ours = next((r for r in real if r.engine == "hetero" and r.prompt_len == n), None)
        theirs = [r for r in real if r.engine in peers and r.prompt_len == n]
        if ours is None or not theirs:
            continue
        best = max(theirs, key=lambda r: r.tokens_per_s)
        out.append({"prompt_len": n, "best_peer": best.engine, "peer_tokens_per_s": best.tokens_per_s,
                    "hetero_tokens_per_s": ours.tokens_per_s, "hetero_over": round(ours.tokens_per_s / best.tokens_per_s, 3)})
    return out


def fraction_of_bound(rows: list[Row], bound: dict[str, Any], engine: str = "hetero") -> list[dict[str, Any]]:
    """An engine's tokens/s over the machine's bound (`bench.machine_bound`) per prompt length."""
    ours = {r.prompt_len: r for r in rows if r.engine == engine and not r.simulated}
    return [{"prompt_len": b["prompt_len"], "fraction": round(ours[b["prompt_len"]].tokens_per_s / b["bound_tokens_per_s"], 3)}
            for b in bound["per_len"] if b["prompt_len"] in ours]


def best_peer_fraction(best: list[dict[str, Any]], bound: dict[str, Any]) -> list[dict[str, Any]]:
    """The fastest peer's tokens/s over the machine's bound, per prompt length (`vs_best_peer` rows)."""
    by_len = {b["prompt_len"]: b["bound_tokens_per_s"] for b in bound["per_len"]}
    return [{"prompt_len": r["prompt_len"], "engine": r["best_peer"],
             "fraction": round(r["peer_tokens_per_s"] / by_len[r["prompt_len"]], 3)} for r in best if r["prompt_len"] in by_len]


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
    if result.get("vs_best_peer"):
        lines += ["", "## hetero vs the fastest peer at each length (real, same run)", "",
                  "| prompt | fastest peer | its tokens/s | hetero tokens/s | hetero / peer |", "|---:|---|---:|---:|---:|"]
        lines += [f"| {r['prompt_len']} | {r['best_peer']} | {r['peer_tokens_per_s']:.1f} | {r['hetero_tokens_per_s']:.1f} | "
                  f"{r['hetero_over']:.2f} |" for r in result["vs_best_peer"]]
    if result.get("peers"):
        lines += ["", "Peers, each built from the same GGUF by its own tools (`bench.peers`): "
                  + "; ".join(f"`{k}`: {v}" for k, v in result["peers"].items()) + "."]
    if result["ratios"]:
        lines += ["", "## hetero's speed over each engine (real, same run)", "", "| prompt | vs | × |", "|---:|---|---:|"]
        lines += [f"| {r['prompt_len']} | {r['vs']} | {r['hetero_over']:.2f} |" for r in result["ratios"]]
    if result.get("bound", {}).get("best_ops_per_s"):  # a result of a run before issue 24 has no such rates
        b = result["bound"]
        frac = {f["prompt_len"]: f["fraction"] for f in b["hetero_fraction"]}
        peer = {f["prompt_len"]: f for f in b.get("best_peer_fraction", [])}
        best = ", ".join(f"{p} {r / 1e9:.0f}" for p, r in b["best_ops_per_s"].items())
        lines += ["", f"## The machine's bound (same run, {b['threads']} threads; `bench.machine_bound`)", "",
                  f"Best measured GEMM rate per precision, G(FL)OP/s: {best}. Linears at the {b['linear_precision']} "
                  f"rate, attention at the {b['attention_precision']} rate.", "",
                  "| prompt | bound tokens/s | hetero / bound | fastest peer / bound |", "|---:|---:|---:|---:|"]
        lines += [f"| {p['prompt_len']} | {p['bound_tokens_per_s']:.0f} | {frac.get(p['prompt_len'], float('nan')):.2f} | "
                  + (f"{peer[p['prompt_len']]['fraction']:.2f} ({peer[p['prompt_len']]['engine']})" if p['prompt_len'] in peer else "")
                  + " |" for p in b["per_len"]]
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
