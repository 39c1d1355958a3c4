"""One chunk's prefill attention: hetero's BF16 kernel (`native.attention`) beside ONNX Runtime's fp32
GroupQueryAttention (`attention.ChunkAttention`), one thread each (a wavefront lane), the model's head layout, the
same rows and cache; speed (medians, the two interleaved) and each one's error against an fp64 reference (issue 24).

    python bench/attention_kernel.py --out bench/results     # writes bench/results/attention_kernel.{json,md}
"""

from __future__ import annotations

if __name__ == "__main__":  # `python bench/<name>.py`: run as module `bench.<name>`, the checkout on the path
    import pathlib
    import sys
    sys.path[0] = str(pathlib.Path(__file__).resolve().parents[1])
    from bench.entry import script
    sys.exit(script(__file__))

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from hetero.arguments import add_model_arg, positive_int
from bench.entry import write_json_md
from bench.host import describe, host

HELP = "hetero's BF16 attention kernel beside ONNX Runtime's fp32 GroupQueryAttention, one chunk, one thread"
SHAPES = ((32, 0), (32, 32), (128, 128), (256, 0), (256, 768), (256, 1792))  # (chunk rows, keys before them)


def _reference(cfg, qkv: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, cos, sin) -> np.ndarray:
    """The chunk's causal attention over the cache rows [0, start + n) in fp64 (k: the roped cache rows)."""
    n, h, kv, d = qkv.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    half = d // 2
    q = qkv[:, : h * d].astype(np.float64).reshape(n, h, d)
    c, s = cos[start : start + n, None, :], sin[start : start + n, None, :]
    q = np.concatenate([q[..., :half] * c - q[..., half:] * s, q[..., half:] * c + q[..., :half] * s], -1)
    out = np.empty((n, h, d))
    keys = np.arange(start + n)
    for i in range(h):
        g = i // (h // kv)
        sc = q[:, i] @ k[g, : start + n].astype(np.float64).T * cfg.scale
        sc[keys[None] > (start + np.arange(n))[:, None]] = -np.inf
        e = np.exp(sc - sc.max(1, keepdims=True))
        out[:, i] = (e / e.sum(1, keepdims=True)) @ v[g, : start + n].astype(np.float64)
    return out.reshape(n, h * d)


def measure(cfg, rows: int, past: int, repeats: int) -> dict:
    from hetero.attention import ChunkAttention
    from hetero.native.attention import Bf16Attention
    from hetero.rope import RopeTable

    rope = RopeTable(cfg, past + rows)
    cos, sin = np.ascontiguousarray(rope.cos), np.ascontiguousarray(rope.sin)
    rng = np.random.default_rng(rows + past)
    qkv = rng.standard_normal((rows, cfg.q_dim + 2 * cfg.kv_dim)).astype(np.float32)
    cache = rng.standard_normal((2, cfg.n_kv_heads, past + rows, cfg.head_dim)).astype(np.float32)
    kernels = {"gqa": ChunkAttention(cfg, cos, sin, threads=1), "bf16": Bf16Attention(cfg)}
    caches = {name: (cache[0].copy(), cache[1].copy()) for name in kernels}
    outs = {name: np.empty((rows, cfg.q_dim), np.float32) for name in kernels}

    def call(name: str) -> None:
        k, v = caches[name]
        if name == "gqa":
            kernels[name](qkv, k, v, past, outs[name])
        else:
            kernels[name](qkv, k, v, past, cos, sin, outs[name])

    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(repeats + 1):  # interleaved; the first round is a warm-up
        for name in kernels:
            t0 = time.perf_counter()
            call(name)
            times[name].append(time.perf_counter() - t0)
    want = _reference(cfg, qkv, caches["gqa"][0], caches["gqa"][1], past, cos, sin)
    flops = 4 * rows * (past + rows / 2) * cfg.head_dim * cfg.n_heads  # QKᵀ and PV, causal
    row = {"rows": rows, "keys_before": past, "load": round(os.getloadavg()[0], 2)}
    for name in kernels:
        ms = float(np.median(times[name][1:])) * 1e3
        err = float(np.abs(outs[name] - want).max() / np.abs(want).max())
        row[name] = {"ms": round(ms, 4), "gflops": round(flops / ms / 1e6, 1), "rel_max_err": float(f"{err:.2e}")}
    row["speedup"] = round(row["gqa"]["ms"] / row["bf16"]["ms"], 2)
    return row


def markdown(r: dict) -> str:
    lines = [f"# One chunk's attention: hetero's BF16 kernel vs ONNX Runtime's GroupQueryAttention ({r['model']})", "",
             f"Reproduce: `{r['command']}`. {r['machine']}. One thread each, {r['heads']}; random rows, the same "
             "rows and cache for both, medians of the repeats, the two interleaved. GFLOP/s: causal QKᵀ and PV work. "
             "Error: max |Δ| / max |out| against an fp64 reference.", "",
             "| rows | keys before | GQA fp32 ms | BF16 kernel ms | speed-up | GQA GFLOP/s | BF16 GFLOP/s | GQA error | "
             "BF16 error | load |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["rows"]:
        g, b = x["gqa"], x["bf16"]
        lines.append(f"| {x['rows']} | {x['keys_before']} | {g['ms']} | {b['ms']} | {x['speedup']}× | {g['gflops']} | "
                     f"{b['gflops']} | {g['rel_max_err']:.1e} | {b['rel_max_err']:.1e} | {x['load']} |")
    return "\n".join(lines) + "\n"


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument("--repeats", type=positive_int, default=15)
    p.add_argument("--out", default=None, help="directory for attention_kernel.{json,md} (default: print only)")


def run(args: argparse.Namespace) -> int:
    from hetero.errors import ConfigError
    from hetero.loader import load_model
    from hetero.native.attention import unavailable

    cfg = load_model(args.model).config
    why = unavailable(cfg)
    if why is not None:
        raise ConfigError(f"the BF16 attention kernel cannot run here: {why}")
    result = {"model": cfg.arch + f" ({cfg.n_heads} query / {cfg.n_kv_heads} KV heads of {cfg.head_dim})",
              "heads": f"{cfg.n_heads} query / {cfg.n_kv_heads} KV heads of {cfg.head_dim}",
              "machine": describe(host()), "host": host(),
              "command": "python bench/attention_kernel.py " + " ".join(sys.argv[1:]),
              "rows": [measure(cfg, n, p, args.repeats) for n, p in SHAPES]}
    if args.out:
        write_json_md(Path(args.out), "attention_kernel", result, markdown(result))
    print(markdown(result))
    return 0
