"""The machine's bound on prefill speed, measured in the same run as the engines it judges (issue 24).

The bound is the machine's, not hetero's kernels': the best measured rate of each precision's GEMM on this
CPU, whatever runs it: ONNX Runtime's u8×s8 `MatMulInteger` (int8), torch's float32 and bfloat16 matmuls,
each at the model's widest linear (rows × hidden × 2·ffn) for two row counts and at a 1024³ square, the best
shape and the fastest of the repeats kept (a bound: another process on a shared core only slows a run). The static linears count at the fastest precision's rate; attention (QKᵀ and PV, causal: half
the square) at the faster float rate (float32 or bfloat16). The bound at n tokens is
n / (linear ops / linear rate + attention FLOPs / float rate), as if every op ran at the machine's best GEMM
speed on every core with nothing else: an engine's tokens/s over it is the fraction of the machine it uses.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hetero.config import ModelConfig
from hetero.sessions import cpu_session
from hetero.threads import set_torch_threads
from hetero.timing import best_seconds

SQUARE = 1024  # the square GEMM measured beside the model's shapes


def int8_gemm_rate(m: int, k: int, n: int, threads: int, repeats: int = 5) -> float:
    """u8×s8 `MatMulInteger` ops/s (2 per multiply-add) through the ONNX Runtime CPU EP: [m, k] × [k, n]."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).integers(-127, 128, (k, n), dtype=np.int8)
    g = helper.make_graph(
        [helper.make_node("MatMulInteger", ["x", "w", "xz"], ["y"])], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [m, n])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(128, np.uint8), "xz")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    sess = cpu_session(model.SerializeToString(), threads)
    x = np.random.default_rng(1).integers(0, 256, (m, k), dtype=np.uint8)
    return 2 * m * k * n / best_seconds(lambda: sess.run(None, {"x": x}), repeats)


def torch_gemm_rate(m: int, k: int, n: int, dtype: str, threads: int, repeats: int = 5) -> float:
    """torch.matmul FLOP/s in `dtype` ("float32" or "bfloat16": oneDNN's AVX-512 BF16 / AMX paths where the CPU has
    them)."""
    import torch

    dtype = getattr(torch, dtype)
    set_torch_threads(threads)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    out = torch.empty(m, n, dtype=dtype)

    def run() -> None:
        with torch.inference_mode():
            torch.matmul(a, b, out=out)

    return 2 * m * k * n / best_seconds(run, repeats)


def gemm_shapes(cfg: ModelConfig) -> list[tuple[int, int, int]]:
    """(m, k, n) measured per precision: the model's widest linear at 256 and 1024 rows, and a square."""
    return [(256, cfg.hidden, 2 * cfg.ffn), (1024, cfg.hidden, 2 * cfg.ffn), (SQUARE, SQUARE, SQUARE)]


def gemm_rates(shapes: list[tuple[int, int, int]], threads: int) -> dict[str, dict[str, float]]:
    """{precision: {"m×k×n": ops/s}} for int8 (ORT u8×s8), float32 and bfloat16 (torch) at each shape."""
    out: dict[str, dict[str, float]] = {"int8": {}, "float32": {}, "bfloat16": {}}
    for m, k, n in shapes:
        key = f"{m}x{k}x{n}"
        out["int8"][key] = int8_gemm_rate(m, k, n, threads)
        out["float32"][key] = torch_gemm_rate(m, k, n, "float32", threads)
        out["bfloat16"][key] = torch_gemm_rate(m, k, n, "bfloat16", threads)
    return out


def linear_ops_per_token(cfg: ModelConfig) -> float:
    """Multiply-add ops ×2 of every static linear of every layer for one token."""
    per_layer = cfg.hidden * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * cfg.hidden + 3 * cfg.hidden * cfg.ffn
    return 2.0 * per_layer * cfg.n_layers


def attention_flops(cfg: ModelConfig, n: int) -> float:
    """QKᵀ and PV of a causal n-token prompt over all layers (half the square)."""
    return 2 * 2 * cfg.n_heads * cfg.head_dim * (n * (n + 1) / 2) * cfg.n_layers


def bound_tokens_per_s(cfg: ModelConfig, n: int, linear_rate: float, attention_rate: float) -> float:
    """n tokens over the time of every linear at `linear_rate` plus attention at `attention_rate`."""
    return n / (n * linear_ops_per_token(cfg) / linear_rate + attention_flops(cfg, n) / attention_rate)


def machine_bound(cfg: ModelConfig, lens: list[int], threads: int,
                  shapes: list[tuple[int, int, int]] | None = None) -> dict[str, Any]:
    """Measured GEMM rates per precision and shape (`gemm_shapes` unless given), the rates the bound uses, and
    the bound per prompt length."""
    rates = gemm_rates(shapes or gemm_shapes(cfg), threads)
    best = {p: max(by_shape.values()) for p, by_shape in rates.items()}
    linear_precision = max(best, key=best.get)
    attention_precision = max(("float32", "bfloat16"), key=best.get)
    linear_rate, attention_rate = best[linear_precision], best[attention_precision]
    return {"gemm_ops_per_s": {p: {s: round(r) for s, r in by.items()} for p, by in rates.items()},
            "best_ops_per_s": {p: round(r) for p, r in best.items()},
            "linear_precision": linear_precision, "linear_ops_per_s": round(linear_rate),
            "attention_precision": attention_precision, "attention_flop_per_s": round(attention_rate),
            "linear_ops_per_token": linear_ops_per_token(cfg), "threads": threads,
            "per_len": [{"prompt_len": n, "bound_tokens_per_s": round(bound_tokens_per_s(cfg, n, linear_rate,
                                                                                           attention_rate), 1)}
                        for n in lens]}
