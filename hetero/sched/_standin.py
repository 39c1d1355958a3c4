"""Stand-in subgraphs with a model's shapes, built from bare ONNX Runtime and torch ops.

Used only to measure a host profile before hetero's real graphs exist (see profiling.standin_runner).
Weights are random: latency does not depend on their values.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from hetero.sched.profiling import NotMeasured


def _rmsnorm(nodes: list, inits: list, x: str, out: str, hidden: int, tag: str) -> None:
    from onnx import helper, numpy_helper

    inits += [numpy_helper.from_array(np.ones(hidden, np.float32), f"{tag}_g"),
              numpy_helper.from_array(np.array([-1], np.int64), f"{tag}_ax"),
              numpy_helper.from_array(np.array(1e-5, np.float32), f"{tag}_eps")]
    nodes += [helper.make_node("Mul", [x, x], [f"{tag}_sq"]),
              helper.make_node("ReduceMean", [f"{tag}_sq", f"{tag}_ax"], [f"{tag}_ms"]),
              helper.make_node("Add", [f"{tag}_ms", f"{tag}_eps"], [f"{tag}_mse"]),
              helper.make_node("Sqrt", [f"{tag}_mse"], [f"{tag}_rms"]),
              helper.make_node("Div", [x, f"{tag}_rms"], [f"{tag}_n"]),
              helper.make_node("Mul", [f"{tag}_n", f"{tag}_g"], [out])]


def _qlinear(nodes: list, inits: list, x: str, out: str, k: int, n: int, tag: str, rng) -> None:
    """out = dequant(quant_u8(x) @ W_int8): DynamicQuantizeLinear + MatMulInteger (u8 x s8)."""
    from onnx import TensorProto, helper, numpy_helper

    inits += [numpy_helper.from_array(rng.integers(-127, 128, (k, n), dtype=np.int8), f"{tag}_w"),
              numpy_helper.from_array(np.array(0.01, np.float32), f"{tag}_ws")]
    nodes += [helper.make_node("DynamicQuantizeLinear", [x], [f"{tag}_q", f"{tag}_s", f"{tag}_z"]),
              helper.make_node("MatMulInteger", [f"{tag}_q", f"{tag}_w", f"{tag}_z"], [f"{tag}_i"]),
              helper.make_node("Cast", [f"{tag}_i"], [f"{tag}_f"], to=TensorProto.FLOAT),
              helper.make_node("Mul", [f"{tag}_s", f"{tag}_ws"], [f"{tag}_sc"]),
              helper.make_node("Mul", [f"{tag}_f", f"{tag}_sc"], [out])]


def _session(kind: str, c: int, hidden: int, q_dim: int, kv_dim: int, ffn: int, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    nodes: list = []
    inits: list = []
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [c, hidden])]
    if kind == "qkv":
        _rmsnorm(nodes, inits, "x", "xn", hidden, "n1")
        _qlinear(nodes, inits, "xn", "y", hidden, q_dim + 2 * kv_dim, "qkv", rng)
        out_dim = q_dim + 2 * kv_dim
    else:  # o_ffn: O proj, +residual, RMSNorm, gate/up, SiLU*mul, down, +residual
        inputs.append(helper.make_tensor_value_info("res", TensorProto.FLOAT, [c, hidden]))
        _qlinear(nodes, inits, "x", "o", q_dim, hidden, "o", rng)
        nodes.append(helper.make_node("Add", ["o", "res"], ["h"]))
        _rmsnorm(nodes, inits, "h", "hn", hidden, "n2")
        _qlinear(nodes, inits, "hn", "gu", hidden, 2 * ffn, "gu", rng)
        nodes.append(helper.make_node("Split", ["gu"], ["g", "u"], axis=1, num_outputs=2))
        nodes += [helper.make_node("Sigmoid", ["g"], ["sg"]), helper.make_node("Mul", ["g", "sg"], ["silu"]),
                  helper.make_node("Mul", ["silu", "u"], ["act"])]
        _qlinear(nodes, inits, "act", "d", ffn, hidden, "down", rng)
        nodes.append(helper.make_node("Add", ["d", "h"], ["y"]))
        out_dim = hidden
    graph = helper.make_graph(nodes, kind, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [c, out_dim])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {i.name: rng.standard_normal((c, hidden)).astype(np.float32) for i in inputs}
    return sess, feeds


def make_runner(hidden: int, n_heads: int, n_kv_heads: int, ffn: int, max_kv: int, threads: int):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)  # the lanes share the host's cores; this process is a profiler
    head_dim = hidden // n_heads
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    k_cache = torch.zeros(n_kv_heads, max_kv, head_dim)
    v_cache = torch.zeros(n_kv_heads, max_kv, head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))

    @functools.lru_cache(maxsize=None)
    def sess(kind: str, c: int):
        return _session(kind, c, hidden, q_dim, kv_dim, ffn, threads)

    @functools.lru_cache(maxsize=None)
    def attn_inputs(c: int):
        g = torch.Generator().manual_seed(0)
        qkv = torch.randn(c, q_dim + 2 * kv_dim, generator=g)
        return qkv, torch.randn(c, 8, generator=g), torch.randn(8, 3 * hidden, generator=g)

    def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x: [H, C, D]
        ang = pos[:, None].float() * inv_freq[None, :]
        cos, sin = ang.cos(), ang.sin()
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def attn(c: int, kv_len: int) -> None:
        qkv, _, _ = attn_inputs(c)
        start = kv_len - c
        pos = torch.arange(start, kv_len)
        q = rope(qkv[:, :q_dim].view(c, n_heads, head_dim).transpose(0, 1), pos)
        k = rope(qkv[:, q_dim:q_dim + kv_dim].view(c, n_kv_heads, head_dim).transpose(0, 1), pos)
        k_cache[:, start:kv_len] = k  # write_kv_inplace
        v_cache[:, start:kv_len] = qkv[:, q_dim + kv_dim:].view(c, n_kv_heads, head_dim).transpose(0, 1)
        mask = torch.ones(c, kv_len, dtype=torch.bool).tril(diagonal=start)
        F.scaled_dot_product_attention(q, k_cache[:, :kv_len], v_cache[:, :kv_len], attn_mask=mask,
                                       scale=1 / math.sqrt(head_dim), enable_gqa=True)

    def run(kind: str, lane: str, c: int, kv_len: int) -> None:
        if lane == "npu" and kind in ("qkv", "o_ffn"):
            s, feeds = sess(kind, c)
            s.run(None, feeds)
        elif lane == "cpu" and kind == "attn":
            attn(c, max(kv_len, c))
        elif lane == "cpu" and kind == "shadow":  # ~8 kept outlier channels of q/k/v/gate/up inputs
            _, xo, wo = attn_inputs(c)
            xo @ wo
        else:
            raise NotMeasured(f"{kind} on {lane}")

    return run
