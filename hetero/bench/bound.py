"""The machine's bound on prefill speed, measured in the same run as the engines it judges.

Two rates on this machine: ONNX Runtime's u8×s8 `MatMulInteger` (the static linears, one layer's widest
GEMM at C rows) and the faster of two float attention kernels, causal at the prompt's length: torch's
fused SDPA and ONNX Runtime's GroupQueryAttention (`hetero.attention`, what hetero's CPU lane runs). The
bound at n tokens is n / (linear ops / GEMM rate + attention FLOPs / attention rate), as if both ran at
full speed on every core with nothing else: hetero's tokens/s over it is the fraction of the machine it uses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hetero.config import ModelConfig
from hetero.sessions import cpu_session
from hetero.threads import set_torch_threads
from hetero.timing import median_seconds


def gemm_rate(cfg: ModelConfig, rows: int, threads: int, repeats: int = 5) -> float:
    """u8×s8 MatMulInteger ops/s (2 per multiply-add) through the ORT CPU EP: [rows, hidden] × [hidden, 2·ffn]."""
    from onnx import TensorProto, helper, numpy_helper

    k, n = cfg.hidden, 2 * cfg.ffn
    w = np.random.default_rng(0).integers(-63, 64, (k, n), dtype=np.int8)
    g = helper.make_graph(
        [helper.make_node("MatMulInteger", ["x", "w", "xz"], ["y"])], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, [rows, k])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [rows, n])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(128, np.uint8), "xz")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    sess = cpu_session(m.SerializeToString(), threads)
    x = np.random.default_rng(1).integers(0, 256, (rows, k), dtype=np.uint8)
    return 2 * rows * k * n / median_seconds(lambda: sess.run(None, {"x": x}), repeats)


def attention_rates(cfg: ModelConfig, n: int, threads: int, repeats: int = 3) -> dict[str, float]:
    """Causal float attention FLOP/s of one layer over an n-token prompt, per kernel (GQA shapes)."""
    from hetero.attention import ChunkAttention
    from hetero.model import RopeTable

    set_torch_threads(threads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, cfg.n_heads, n, cfg.head_dim, generator=g)
    kv = torch.randn(1, cfg.n_kv_heads, n, cfg.head_dim, generator=g)

    def sdpa() -> None:
        with torch.inference_mode():
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)

    rope = RopeTable(cfg, n)
    gqa = ChunkAttention(cfg, rope.cos, rope.sin, threads)
    qkv = torch.randn(n, cfg.q_dim + 2 * cfg.kv_dim, generator=g)
    cache = torch.empty(2, cfg.n_kv_heads, n, cfg.head_dim)
    out = torch.empty(n, cfg.q_dim)
    flops = attention_flops(cfg, n) / cfg.n_layers
    return {"torch_sdpa": flops / median_seconds(sdpa, repeats),
            "ort_gqa": flops / median_seconds(lambda: gqa(qkv, cache[0], cache[1], 0, out), repeats)}


def linear_ops_per_token(cfg: ModelConfig) -> float:
    """Multiply-add ops ×2 of every static linear of every layer for one token."""
    per_layer = cfg.hidden * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * cfg.hidden + 3 * cfg.hidden * cfg.ffn
    return 2.0 * per_layer * cfg.n_layers


def attention_flops(cfg: ModelConfig, n: int) -> float:
    """QKᵀ and PV of a causal n-token prompt over all layers (half the square)."""
    return 2 * 2 * cfg.n_heads * cfg.head_dim * (n * (n + 1) / 2) * cfg.n_layers


def machine_bound(cfg: ModelConfig, lens: list[int], threads: int, rows: int = 256) -> dict[str, Any]:
    """Measured rates and the bound tokens/s per prompt length."""
    gops = gemm_rate(cfg, rows, threads)
    out: dict[str, Any] = {"gemm_ops_per_s": round(gops), "linear_ops_per_token": linear_ops_per_token(cfg),
                           "threads": threads, "per_len": []}
    for n in lens:
        rates = attention_rates(cfg, n, threads)
        kernel = max(rates, key=rates.get)
        seconds = n * linear_ops_per_token(cfg) / gops + attention_flops(cfg, n) / rates[kernel]
        out["per_len"].append({"prompt_len": n, "attention_flop_per_s": round(rates[kernel]),
                               "attention_kernel": kernel,
                               "attention_flop_per_s_by_kernel": {k: round(r) for k, r in rates.items()},
                               "bound_tokens_per_s": round(n / seconds, 1)})
    return out
