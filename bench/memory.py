"""`hetero bench memory`: where a prefill's resident memory goes, per component, one fresh process each.

A worker per engine records RSS (anonymous and file-backed, /proc/self/status) after each stage: libraries,
model (mapped from the model cache), the quantization plan, the runtime (ONNX Runtime sessions holding the
NPU lane's INT8 weights), then a prefill per prompt length (KV cache, activations, shadow rows, logits).
Sizes the process can count exactly (KV bytes, INT8 weights the CPU keeps) sit beside the measured deltas.

    python bench/memory.py [--lens 64,256,1024,2048] [--threads 2] [--out bench/results]   # memory.{json,md}
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
import resource
import subprocess
import sys
from typing import Any

from bench.entry import add_out_arg, child_env, out_dir, write_json_md, wrote
from hetero.arguments import add_model_arg, int_list, positive_int

HELP = "peak and per-component resident memory of a hetero and a torch float prefill"
ENGINES = ("hetero", "torch_float")


def _rss() -> dict[str, float]:
    with open("/proc/self/status") as f:
        d = {ln.split(":")[0]: int(ln.split()[1]) / 1024 for ln in f if ln.startswith(("RssAnon", "RssFile"))}
    d["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {k: round(v, 1) for k, v in d.items()}


def run_worker(engine: str, model_path: str | None, lens: list[int], threads: int) -> dict[str, Any]:
    """Stages of one engine in this process (call in a fresh one). The libraries stage loads what the engine's
    process loads: torch for transformers' engine only (hetero's default path runs without it, issue 28; a hetero
    method that needs torch loads it later, inside its own stages)."""
    import numpy as np
    import onnxruntime  # noqa: F401

    if engine == "torch_float":
        import torch  # noqa: F401

    from hetero.outliers.corpus import prompt_ids
    from hetero.loader import load_model

    stages = [("libraries", _rss())]
    prompts = {n: prompt_ids(model_path, n) for n in lens}
    model = load_model(model_path)
    stages.append(("model (mapped)", _rss()))
    counts: dict[str, float] = {}
    if engine == "torch_float":
        from hetero.adapters.hf import to_hf_model
        from hetero.methods import use_threads

        use_threads(threads)
        hf = to_hf_model(model)
        stages.append(("transformers model (float32)", _rss()))

        def prefill(ids: np.ndarray) -> None:
            with torch.inference_mode():
                hf(torch.from_numpy(ids)[None], logits_to_keep=1, use_cache=True)
    else:
        from hetero.methods import make_runtime

        rt = make_runtime(model, engine, threads=threads)
        stages.append(("plan + runtime (ORT sessions)", _rss()))
        plan = getattr(rt.backend, "plan", None)
        if plan is not None:
            counts["int8_weights_kept_on_cpu_mb"] = round(sum(w.q.nbytes for w in plan.weights.values()) / 2**20, 1)

        def prefill(ids: np.ndarray) -> None:
            rt.prefill(ids)
    cfg = model.config
    for n in lens:
        prefill(prompts[n])
        stages.append((f"prefill {n}", _rss()))
        counts[f"kv_cache_{n}_mb"] = round(2 * cfg.n_layers * cfg.kv_dim * n * 4 / 2**20, 1)
    return {"engine": engine, "stages": [{"stage": s, **r} for s, r in stages], "exact": counts}


def run_memory_bench(lens: list[int], threads: int, model_path: str | None = None) -> dict[str, Any]:
    rows = []
    for engine in ENGINES:
        cmd = [sys.executable, "-m", "bench", "memory", "--worker", engine, "--lens", ",".join(map(str, lens)),
               "--threads", str(threads)] + (["--model", model_path] if model_path else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=child_env()).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return {"lens": lens, "threads": threads, "engines": rows}


def markdown(result: dict[str, Any]) -> str:
    lines = ["# Resident memory per stage (MB; fresh process per engine; `hetero bench memory`)", ""]
    for e in result["engines"]:
        lines += [f"## {e['engine']}", "", "| stage | anonymous | file-backed | peak so far |", "|---|---:|---:|---:|"]
        lines += [f"| {s['stage']} | {s['RssAnon']:.0f} | {s['RssFile']:.0f} | {s['peak']:.0f} |" for s in e["stages"]]
        if e["exact"]:
            lines += ["", "Counted: " + ", ".join(f"{k} = {v}" for k, v in e["exact"].items())]
        lines.append("")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--lens", default="64,256,1024,2048", help="prompt lengths, in this order in one process")
    p.add_argument("--threads", type=positive_int, default=2)
    add_out_arg(p, "memory.json/.md")
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    lens = int_list(args.lens, "--lens")
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.model, lens, args.threads)))
        return 0
    result = run_memory_bench(lens, args.threads, args.model)
    paths = write_json_md(out_dir(args.out), "memory", result, markdown(result))
    print(markdown(result))
    wrote(paths)
    return 0
