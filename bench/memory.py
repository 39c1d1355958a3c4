"""`hetero bench memory`: where a prefill's resident memory goes, per component, one fresh process each.

A worker per engine records RSS (anonymous and file-backed, /proc/self/status) after each stage: libraries,
model (mapped from the model cache), the quantization plan, the runtime (ONNX Runtime sessions holding the
NPU lane's INT8 weights), then a prefill per prompt length (KV cache, activations, shadow rows, logits) and, for
hetero, `--decode` greedy tokens after the last prompt (issue 41's process: prefill 2,048 tokens, decode 64).
Sizes the process can count exactly sit beside the measured deltas: the bytes of each weight form kept (the
graphs' INT8 linears, which ONNX Runtime holds prepacked; the INT8 weights the CPU keeps for shadows; the decode
GEMVs' arena) and of the KV cache after each prompt.

    python bench/memory.py [--lens 64,256,1024,2048] [--decode 64] [--threads 2] [--out bench/results]
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
import subprocess
import sys
from typing import Any

from bench.conditions import peak_rss_mb
from bench.entry import add_out_arg, child_env, out_dir, write_json_md, wrote
from bench.machine_bound import linear_ops_per_token
from hetero.arguments import add_model_arg, int_list, positive_int
from hetero.errors import ConfigError

HELP = "peak and per-component resident memory of a hetero and a torch float prefill"
ENGINES = ("hetero", "torch_float")


def _rss() -> dict[str, float]:
    with open("/proc/self/status") as f:
        # RssShmem: shared anonymous mappings (`hetero.buffers`' large buffers: the KV cache)
        d = {ln.split(":")[0]: int(ln.split()[1]) / 1024 for ln in f
             if ln.startswith(("RssAnon", "RssFile", "RssShmem"))}
    d["peak"] = peak_rss_mb()
    return {k: round(v, 1) for k, v in d.items()}


def run_worker(engine: str, model_path: str | None, lens: list[int], threads: int, decode: int = 0) -> dict[str, Any]:
    """Stages of one engine in this process (call in a fresh one). The libraries stage loads what the engine's
    process loads: torch for transformers' engine only (hetero's default path runs without it, issue 28; a hetero
    method that needs torch loads it later, inside its own stages). decode: hetero's greedy tokens after the last
    prompt (no stop token ends them early)."""
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

        def prefill(ids: np.ndarray) -> Any:  # (None: no hetero result)
            with torch.inference_mode():
                hf(torch.from_numpy(ids)[None], logits_to_keep=1, use_cache=True)
    else:
        from hetero.methods import make_runtime

        rt = make_runtime(model, engine, threads=threads)
        stages.append(("plan + runtime (ORT sessions)", _rss()))
        plan = getattr(rt.backend, "plan", None)
        if plan is not None:
            # one byte per weight of every layer's linears (`machine_bound` counts two ops per weight and token)
            counts["graph_int8_weights_mb"] = round(linear_ops_per_token(model.config) / 2 / 2**20, 1)
            counts["int8_weights_kept_on_cpu_mb"] = round(sum(w.q.nbytes for w in plan.weights.values()) / 2**20, 1)

        def prefill(ids: np.ndarray) -> Any:
            return rt.prefill(ids)
    cfg, last = model.config, None
    for n in lens:
        last = None  # the previous prompt's result and cache go before the next prompt's (one at a time)
        last = prefill(prompts[n])
        stages.append((f"prefill {n}", _rss()))
        # the bytes the cache wrote; transformers' fp32 cache holds as many
        held = last.cache.held_bytes() if last is not None else 2 * cfg.n_layers * cfg.kv_dim * n * 4
        counts[f"kv_cache_{n}_mb"] = round(held / 2**20, 1)
    if engine != "torch_float":
        if decode and last is not None:
            from hetero.decode import generate
            from hetero.decode.params import SamplingParams

            g = generate(rt, last, SamplingParams(max_new_tokens=decode, stop_token_ids=()),
                         context_ids=prompts[lens[-1]].tolist())
            stages.append((f"decode {len(g.tokens)}", _rss()))
            counts[f"kv_cache_{lens[-1]}+{len(g.tokens)}_mb"] = round(last.cache.held_bytes() / 2**20, 1)
        counts.update({f"{name}_mb": round(b / 2**20, 1) for name, b in rt.owned_bytes().items()})
    return {"engine": engine, "stages": [{"stage": s, **r} for s, r in stages], "exact": counts}


def run_memory_bench(lens: list[int], threads: int, model_path: str | None = None, decode: int = 0) -> dict[str, Any]:
    rows = []
    for engine in ENGINES:
        cmd = [sys.executable, "-m", "bench", "memory", "--worker", engine, "--lens", ",".join(map(str, lens)),
               "--threads", str(threads), "--decode", str(decode)] + (["--model", model_path] if model_path else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=child_env()).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return {"lens": lens, "threads": threads, "decode": decode, "engines": rows}


def markdown(result: dict[str, Any]) -> str:
    lines = ["# Resident memory per stage (MB; fresh process per engine; `hetero bench memory`)", ""]
    for e in result["engines"]:
        lines += [f"## {e['engine']}", "", "| stage | anonymous | file-backed | shared (KV cache) | peak so far |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {s['stage']} | {s['RssAnon']:.0f} | {s['RssFile']:.0f} | {s.get('RssShmem', 0):.0f} "
                  f"| {s['peak']:.0f} |" for s in e["stages"]]
        if e["exact"]:
            lines += ["", "Counted: " + ", ".join(f"{k} = {v}" for k, v in e["exact"].items())]
        lines.append("")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--lens", default="64,256,1024,2048", help="prompt lengths, in this order in one process")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--decode", type=int, default=64, help="hetero's tokens to decode after the last prompt (0: none)")
    add_out_arg(p, "memory.json/.md")
    p.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    lens = int_list(args.lens, "--lens")
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.model, lens, args.threads, args.decode)))
        return 0
    if args.decode < 0:
        raise ConfigError(f"--decode must be >= 0, got {args.decode}")
    result = run_memory_bench(lens, args.threads, args.model, args.decode)
    paths = write_json_md(out_dir(args.out), "memory", result, markdown(result))
    print(markdown(result))
    wrote(paths)
    return 0
