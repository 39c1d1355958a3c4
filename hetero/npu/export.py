"""Export one segment (`segments.SegmentSpec`) as a fixed-shape INT8 ONNX graph (mllm-NPU §3.2).

Flavours of the same math: "cpu" (ONNX Runtime CPU EP: QuantizeLinear u8 → MatMulInteger with s8 or u8
weights (the plan's weight form, `cpu_kernel`) → Cast → Mul by the float32 output scales, equal to
`outliers.quantize.int8_linear`, the test checks it) and "qnn" / "qnn-fp16" (QDQ around a float MatMul for HTP). RMSNorm, residual adds and
SiLU·mul stay float ops inside the graph. Equivalent shapes "3d:a" / "conv:a" (§4) reshape once at entry
and exit. Derivations and the HTP constraints behind each choice: docs/design.md, "NPU graphs".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from hetero.attention import GQA_INPUTS, GQA_OUTPUTS, gqa_node
from hetero.npu.segments import (EXPORT_VERSION, LAYER_VERSION, AttnSpec, Buffer, LayerQ, LinearQ,  # noqa: F401
                                  SegmentSpec, segment_io, shape_rows)
from hetero.errors import ConfigError
from hetero.native import ort_ops
from hetero.npu.site_ops import a16_bytes, a16_combine, online_hadamard, row_scaled
from hetero.outliers.quantize import ACT_QMAX, ACT_QMIN, ACT_ZERO_POINT, WEIGHT_FORMS, check_weight_form

# EXPORT_VERSION, LAYER_VERSION: what this module builds, in every graph's cache key; kept in `segments` (no onnx),
# which a warm start reads without importing this module and onnx.
ACT_ZERO_POINT_U16 = 32768
OPSET = 21
# ---------------------------------------------------------------------------------------- builder


class GraphBuilder:
    """A tiny ONNX graph builder with deterministic names (ORT quantization tool style)."""

    def __init__(self, name: str):
        self.name, self.nodes, self.inits, self.inputs, self.outputs = name, [], [], [], []
        self._n = 0
        self._consts: dict[bytes, str] = {}
        self.domains: set[str] = {""}

    def fresh(self, stem: str) -> str:
        self._n += 1
        return f"{stem}_{self._n}"

    def const(self, arr: np.ndarray, stem: str = "c") -> str:
        arr = np.ascontiguousarray(arr)
        key = arr.dtype.str.encode() + str(arr.shape).encode() + arr.tobytes() if arr.size <= 64 else None
        if key is not None and key in self._consts:
            return self._consts[key]
        name = self.fresh(stem)
        self.inits.append(numpy_helper.from_array(arr, name))
        if key is not None:
            self._consts[key] = name
        return name

    def op(self, op_type: str, inputs: list[str], stem: str | None = None, domain: str = "", **attrs) -> str:
        out = self.fresh(stem or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out + "_" + op_type, domain=domain, **attrs))
        self.domains.add(domain)
        return out

    def op_n(self, op_type: str, inputs: list[str], stems: list[str], domain: str = "", **attrs) -> list[str]:
        """A node with one output per stem."""
        outs = [self.fresh(stem) for stem in stems]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=outs[0] + "_" + op_type, domain=domain, **attrs))
        self.domains.add(domain)
        return outs

    def input(self, name: str, shape: list[int | str], dtype: int = TensorProto.FLOAT) -> str:
        name = str(name)
        self.inputs.append(helper.make_tensor_value_info(name, dtype, shape))
        return name

    def output(self, src: str | None, name: str, shape: list[int | str]) -> None:
        """Graph output `name` [shape] float32: a copy of `src`, or (src None) a tensor a node writes under that name."""
        name = str(name)
        if src is not None:
            self.nodes.append(helper.make_node("Identity", [src], [name], name=name + "_out"))
        self.outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))

    def model(self) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        opsets = [helper.make_opsetid("", OPSET)] + [helper.make_opsetid(d, 1) for d in sorted(self.domains - {""})]
        m = helper.make_model(g, opset_imports=opsets, producer_name="hetero.npu")
        m.ir_version = 10
        return m


def rms_norm(g: GraphBuilder, x: str, w: np.ndarray, eps: float, flavor: str) -> str:
    """x / sqrt(mean(x²) + eps) * w.

    cpu: the Pow→ReduceMean→Add→Sqrt→Div→Mul pattern ORT fuses into SimplifiedLayerNormalization.
    qnn: the same pattern (the generic HTP simulator fails to finalize graphs with more float ops).
    qnn-fp16 (HTP running float ops in fp16: a device, or the simulator with a soc_model): the same value
    computed on x/m with m = max|x| per row, i.e. (x/m) / sqrt(mean((x/m)²) + (√eps/m)²). x² overflows fp16
    once |x| > 256, and SmolLM2's residual stream reaches 24,886 (`constraints` "soc_model_fp16");
    (x/m)² <= 1 never overflows and its mean is >= 1/K, so it cannot vanish either. On the soc-60 simulator
    one row of layer 1 still comes out wrong (`constraints` "soc_model_fp16"): not validated yet.
    """
    if flavor == "qnn-fp16":
        m = g.op("ReduceMax", [g.op("Abs", [x]), g.const(np.array([-1], np.int64))], "rowmax", keepdims=1)
        x = g.op("Div", [x, m], "xn")
        e = g.op("Div", [g.const(np.array(np.sqrt(eps), np.float32), "eps_sqrt"), m])
        eps_t = g.op("Mul", [e, e], "eps_n")
    else:
        eps_t = g.const(np.array(eps, np.float32))
    sq = g.op("Pow", [x, g.const(np.array(2.0, np.float32))])
    ms = g.op("ReduceMean", [sq, g.const(np.array([-1], np.int64))], keepdims=1)
    rs = g.op("Sqrt", [g.op("Add", [ms, eps_t])])
    return g.op("Mul", [g.op("Div", [x, rs]), g.const(w.astype(np.float32), "norm_w")])


# QDQ form of per-channel weights. The standard one is DequantizeLinear with per-axis scales on the weight's
# output dim (axis=1 of [K, N]); the QNN EP of onnxruntime-qnn 2.7.0 (HTP simulator) rejects a per-axis
# DequantizeLinear feeding MatMul (tried axis 0/1/-1, rank-2/3 input, 16-bit activations, Gemm), so by
# default the weight is dequantized per tensor at its largest channel scale and the rest is folded *after*
# the MatMul: Mul by the float32 vector s_w[col] / max s_w (<= 1). Not scale 1 with Mul(s_w[col]): the
# integer-valued weights would make the MatMul's outputs ~1/s_w too large for HTP's fp16 (overflow).
QNN_PER_AXIS_DQ = False


def cpu_kernel(weight_form: str) -> str:
    """How the CPU EP's MatMulInteger takes the weights of a plan of `weight_form` ("u8s8" | "u8u8").

    ORT's u8·s8 GEMM on AVX2 without VNNI multiplies with vpmaddubsw: two adjacent u8·s8 products are
    summed into a saturating int16. The stored activation is the raw u8 in [0, 255] (zero point 128 is
    corrected afterwards), so the pair sum reaches 2·255·|q|: 2·255·127 = 64770 > 32767 (wrong int32
    results) but 2·255·64 = 32640 <= 32767 (exact). Hence 7-bit weights (the plan's default weight_qmax
    = 63, ORT's reduce_range) run u8·s8 with s8 weights, zero point 0. Full 8-bit weights fall back to
    u8·u8 (weights stored q + 128 with zero point 128, vpmaddwd: exact, same int32 result), which is
    slower (docs/journal.md, "NPU graphs").
    """
    return WEIGHT_FORMS[check_weight_form(weight_form)].kernel


def _conv_in(g: GraphBuilder, x: str) -> str:
    """[a, b, K] → [1, K, a, b] (NCHW) for a 1×1 Conv (on the CPU EP the moved tensor is the u8 activation)."""
    return g.op("Unsqueeze", [g.op("Transpose", [x], "nchw", perm=[2, 0, 1]), g.const(np.array([0], np.int64))])


def _conv_out(g: GraphBuilder, y: str) -> str:
    """[1, N, a, b] → [a, b, N]."""
    return g.op("Transpose", [g.op("Squeeze", [y, g.const(np.array([0], np.int64))])], "rows", perm=[1, 2, 0])


def _weight(g: GraphBuilder, w_kn: np.ndarray, conv: bool, stem: str = "w_q") -> str:
    """A weight given as [K, N], stored for MatMul ([K, N]) or for a 1×1 Conv ([N, K, 1, 1])."""
    return g.const(np.ascontiguousarray(w_kn.T)[:, :, None, None] if conv else np.ascontiguousarray(w_kn), stem)


def _product(g: GraphBuilder, op: str, x: str, w: str, extra: list[str], conv: bool) -> str:
    """x @ W: `op` (MatMul / MatMulInteger) over rows, or its 1×1 Conv (Conv / ConvInteger) over x laid
    out NCHW (§4 equivalent shape "conv:a"); `w` stored by `_weight`."""
    if not conv:
        return g.op(op, [x, w, *extra], "y")
    conv_op = {"MatMul": "Conv", "MatMulInteger": "ConvInteger"}[op]
    return _conv_out(g, g.op(conv_op, [_conv_in(g, x), w, *extra], "acc"))


def _linears(g: GraphBuilder, x: str | None, lins: list[LinearQ], flavor: str, qnn_per_axis: bool | None = None,
             conv: bool = False, kernel: str = "u8s8", shadow: bool = False,
             quantized: tuple[str, str] | None = None) -> str:
    """y = concat_j(int8_linear(x, s_x, W_j) + b_j) along the last axis; all lins share x and s_x.

    conv: x is [a, b, K] and each matmul runs as a 1×1 Conv over [1, K, a, b] (bit-identical on the CPU EP:
    ConvInteger accumulates the same int32 products). kernel: the CPU EP's `cpu_kernel` of the plan.
    shadow (CPU flavour, 2-D): + the site's shadow correction (Eq. 1) inside the graph (`_shadow`).
    quantized (CPU flavour, 2-D, no shadow; x None): (xq, row_s), x already quantized as its site says by
    hetero's ops (`_down_input`, `_ffn_input`, `_rotated_input`); a per-row site's product is multiplied by row_s
    (None: the caller does, `ScaleAdd`); a 16-bit site's: (u_hi, u_lo), its int16 grid's bytes (`site_ops.a16_bytes`).
    """
    qnn_per_axis = QNN_PER_AXIS_DQ if qnn_per_axis is None else qnn_per_axis
    s_x = np.float32(lins[0].x_scale)
    bits, per_row = lins[0].x_bits, lins[0].x_per_row
    assert all(np.float32(lq.x_scale) == s_x and (lq.x_bits, lq.x_per_row) == (bits, per_row) for lq in lins), \
        "fused linears share a site"
    if per_row and (flavor != "cpu" or conv):
        raise ConfigError(f"a site with a scale per row runs on the CPU EP's 2-D graphs only, not the {flavor!r} "
                          f"flavour{' as a 1x1 Conv' if conv else ''} (HTP's static graphs keep shadow outliers)")
    zp = g.const(np.array(ACT_ZERO_POINT, np.uint8), "act_zp")
    if quantized is not None:
        if flavor != "cpu" or conv or shadow or (bits == 16 and per_row):
            raise ConfigError("a pre-quantized input runs on the CPU EP's 2-D graphs, without a shadow")
        xq, row_s = quantized if bits == 8 else (None, None)
        s_x = np.float32(1.0) if per_row else s_x
    elif per_row:  # `outliers.rowscale`: the integer product's float32 is multiplied by the row's scale after
        xq, row_s = row_scaled(g, x, zp)
        s_x = np.float32(1.0)
    elif bits == 8:
        xq = g.op("QuantizeLinear", [x, g.const(np.array(s_x, np.float32), "act_s"), zp], "xq")
    has_bias = any(lq.bias is not None for lq in lins)
    if flavor == "cpu":
        # u8·s8 (s8 weights, zp 0) or u8·u8 (weights stored uint8 = q + 128 with zero point 128, same int32
        # result), as the plan's weight form says (`cpu_kernel`)
        wt = np.ascontiguousarray(np.concatenate([lq.q.T for lq in lins], axis=1))  # int8 [K, ΣN]
        if kernel == "u8s8":
            w_zp = g.const(np.array(0, np.int8), "w_zp")
        else:
            wt = (wt.astype(np.int16) + ACT_ZERO_POINT).astype(np.uint8)
            w_zp = g.const(np.array(ACT_ZERO_POINT, np.uint8), "w_zp")
        scales = np.concatenate([_out_scale(s_x, lq) for lq in lins])
        s = scales[:1] if np.all(scales == scales[0]) else scales
        w = _weight(g, wt, conv)
        if bits == 16:  # W8A16: two u8 passes on the bytes of the int16 activation (`site_ops`)
            u_hi, u_lo = quantized if quantized is not None else a16_bytes(g, x, s_x)
            k_hi, lo_zp = (s * np.float32(256)).astype(np.float32), g.const(np.array(0, np.uint8), "lo_zp")
            if conv:
                acc_hi = _product(g, "MatMulInteger", u_hi, w, [zp, w_zp], conv)
                acc_lo = _product(g, "MatMulInteger", u_lo, w, [lo_zp, w_zp], conv)
                y = a16_combine(g, acc_hi, acc_lo, k_hi, s)
            else:  # float(acc)·(1·k) of each pass in its GEMM's epilogue, as the 8-bit product below; then their sum
                one = g.const(np.array(1.0, np.float32), "one")
                y_hi, y_lo = (g.op("MatMulIntegerToFloat", [u, w, one, g.const(k, "acc_s"), z, w_zp], "y",
                                   domain="com.microsoft") for u, k, z in ((u_hi, k_hi, zp), (u_lo, s, lo_zp)))
                y = g.op("Add", [y_hi, y_lo], "y")
        else:
            if conv:
                acc = _product(g, "MatMulInteger", xq, w, [zp, w_zp], conv)
                y = g.op("Mul", [g.op("Cast", [acc], to=TensorProto.FLOAT), g.const(s, "acc_s")], "y")
            else:  # the same float32 ops, float(acc)·(1·s), in the GEMM's epilogue (no int32 tensor, Cast, Mul)
                y = g.op("MatMulIntegerToFloat", [xq, w, g.const(np.array(1.0, np.float32), "one"), g.const(s, "acc_s"),
                                                  zp, w_zp], "y", domain="com.microsoft")
    else:
        s_xc = g.const(np.array(s_x, np.float32), "act_s")
        zp16 = g.const(np.array(ACT_ZERO_POINT_U16, np.uint16), "act_zp16")
        if bits == 16:  # W8A16 QDQ: HTP runs 16-bit activations natively
            xd = g.op("DequantizeLinear", [g.op("QuantizeLinear", [x, s_xc, zp16], "xq16"), s_xc, zp16], "xd")
        else:
            xd = g.op("DequantizeLinear", [xq, s_xc, zp], "xd")
            # The u8 grid re-expressed in u16 (same scale, zp 32768): the QNN EP turns this DQ→Q pair into a
            # u8→u16 Convert, which keeps the u8 Quantize a real rounding op; without it the EP makes the Q→DQ
            # pair on x standalone ops that HTP folds away, and x reaches the MatMul unrounded
            # (`constraints.QNN_CONSTRAINTS`).
            xd = g.op("DequantizeLinear", [g.op("QuantizeLinear", [xd, s_xc, zp16], "xq16"), s_xc, zp16], "xd")
        ys = []
        for lq in lins:
            n = lq.q.shape[0]
            wq = lq.q.T  # int8 [K, N]
            if np.ndim(lq.w_scale) == 0:
                w_s, post = np.array(lq.w_scale, np.float32), None
                w_zp = np.array(0, np.int8)
            elif qnn_per_axis:  # DequantizeLinear with per-axis scales on the output dim
                w_s, post, w_zp = np.asarray(lq.w_scale, np.float32).reshape(n), None, np.zeros(n, np.int8)
            else:  # per-tensor DQ at the largest channel scale, the rest folded after: Mul(s_w[col] / max s_w)
                sw = np.asarray(lq.w_scale, np.float32).reshape(n)
                w_s = np.array(sw.max(), np.float32)
                post, w_zp = (sw / w_s).astype(np.float32), np.array(0, np.int8)
            axis = {"axis": 0 if conv else 1} if w_s.ndim else {}  # the output dim of the stored weight
            wd = g.op("DequantizeLinear", [_weight(g, wq, conv), g.const(w_s, "w_s"), g.const(w_zp, "w_zp")],
                      "wd", **axis)
            y = _product(g, "MatMul", xd, wd, [], conv)
            ys.append(y if post is None else g.op("Mul", [y, g.const(post, "w_s")], "y"))
        y = ys[0] if len(ys) == 1 else g.op("Concat", ys, "y", axis=-1)
    if per_row and row_s is not None:
        y = g.op("Mul", [y, row_s], "y")
    if has_bias:
        b = np.concatenate([lq.bias if lq.bias is not None else np.zeros(lq.q.shape[0], np.float32) for lq in lins])
        y = g.op("Add", [y, g.const(b.astype(np.float32), "bias")])
    if shadow:
        if flavor != "cpu" or conv or bits != 8:
            raise ValueError("an in-graph shadow needs the CPU flavour, 2-D rows and an 8-bit site")
        y = g.op("Add", [y, _shadow(g, x, lins, w, kernel)], "y_shadowed")
    return y


def _shadow(g: GraphBuilder, x: str, lins: list[LinearQ], w: str, kernel: str) -> str:
    """The CPU side of Eq. 1 in the graph, as `outliers.shadow.shadow_part` computes it: r = x − clip(x, lo, hi)
    (lo, hi: the INT8 range, compared in float32 as `rangecheck.split_beyond`), the channels c where some row
    has r ≠ 0 (found at run time), and r[:, c] @ W_deq[:, c]ᵀ with the rows taken from the linear's own INT8 weight
    `w` ([K, ΣN], no float copy of the weights), their per-column scales applied to the product. No outlier: k = 0,
    a zero product.

    The channels are taken by Compress with the channel mask (not NonZero → Reshape → Gather): the same columns
    in the same order, two nodes fewer per site (docs/journal.md, "Issue 24: the float glue")."""
    s = float(lins[0].x_scale)
    lo, hi = g.const(np.array(ACT_QMIN * s, np.float32), "lo"), g.const(np.array(ACT_QMAX * s, np.float32), "hi")
    r = g.op("Sub", [x, g.op("Clip", [x, lo, hi])], "r")
    beyond = g.op("Greater", [g.op("ReduceMax", [g.op("Abs", [r]), g.const(np.array([0], np.int64))], keepdims=0),
                              g.const(np.array(0, np.float32), "zero")], "beyond")
    rows = g.op("Cast", [g.op("Compress", [w, beyond], "w_rows", axis=0)], "w_rows_f", to=TensorProto.FLOAT)
    if kernel != "u8s8":  # stored q + 128 (`cpu_kernel`)
        rows = g.op("Sub", [rows, g.const(np.array(ACT_ZERO_POINT, np.float32), "w_zp_f")], "w_rows_q")
    s_w = np.concatenate([np.broadcast_to(np.asarray(lq.w_scale, np.float32), (lq.q.shape[0],)) for lq in lins])
    # r_c · (q·s_w) as (r_c · q)·s_w: the scales are per output column, so they multiply the [T, N] product instead
    # of the [k, N] rows (k: up to ~600 outlier channels of down_in; T: 32 rows of a short prompt's chunk)
    prod = g.op("MatMul", [g.op("Compress", [r, beyond], "r_c", axis=1), rows], "shadow_q")
    return g.op("Mul", [prod, g.const(s_w.astype(np.float32), "w_s")], "shadow")


def _out_scale(s_x: np.float32, lq: LinearQ) -> np.ndarray:
    """float32 [out]: s_x·s_w (per tensor, repeated) or s_x·s_w[o] (per channel), exactly as
    `quantize.int8_linear` / `int8_linear_per_channel` compute the product (one float32 multiply)."""
    n = lq.q.shape[0]
    if np.ndim(lq.w_scale) == 0:
        return np.full(n, np.float32(s_x) * np.float32(lq.w_scale), np.float32)
    return (np.float32(s_x) * np.asarray(lq.w_scale, np.float32).reshape(n)).astype(np.float32)


def slice_last(g: GraphBuilder, x: str, start: int, end: int) -> str:
    return g.op("Slice", [x, g.const(np.array([start], np.int64)), g.const(np.array([end], np.int64)),
                          g.const(np.array([-1], np.int64))])


def activation(g: GraphBuilder, x: str, act: str) -> str:
    """The gate's activation as `model.activation` computes it (silu: x·sigmoid(x); gelu: erf form; gelu_tanh:
    0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))); relu). The GELUs as ONNX's one Gelu op (opset 20), one pass over
    the [T, ffn] gate where the formula's nodes took eight (Gemma 3 270M's gelu_tanh(gate)·up at 256 rows, one
    thread: 0.38 instead of 0.90 ms)."""
    if act == "silu":
        return g.op("Mul", [x, g.op("Sigmoid", [x])], "silu")
    if act == "relu":
        return g.op("Relu", [x], "relu")
    if act in ("gelu", "gelu_tanh"):
        return g.op("Gelu", [x], act, approximate="tanh" if act == "gelu_tanh" else "none")
    raise ValueError(f"activation {act!r} has no graph")


def _down_input(g: GraphBuilder, gate: str, up: str, lq: LayerQ, block: int | None, shadowed: bool) -> tuple[str, str]:
    """(xq, row_s): down_in's input SiLU(gate)·up, its online Hadamard and u8 quantization (per row, or at the site's
    static scale) as one of hetero's ops (`native.ort_ops`), equal to the nodes it replaces up to float32 rounding."""
    from hetero.outliers.rowscale import ROW_QMAX, ROW_TINY

    if lq.act != "silu" or block != ort_ops.BLOCK or lq.down.x_bits != 8 or shadowed or lq.ffn % block:
        raise ConfigError(f"hetero's {ort_ops.SILU_HADAMARD_QUANT} computes an 8-bit down_in after SiLU with a "
                          f"{ort_ops.BLOCK}-block online Hadamard and no shadow; this layer has {lq.act}, block "
                          f"{block}, {lq.down.x_bits} bits{', a shadow' if shadowed else ''}")
    scale = 0.0 if lq.down.x_per_row else float(np.float32(lq.down.x_scale))
    xq, row_s = g.op_n(ort_ops.SILU_HADAMARD_QUANT, [gate, up], ["xq", "row_s"], domain=ort_ops.DOMAIN,
                       block=ort_ops.BLOCK, scale=scale, qmax=float(ROW_QMAX), tiny=float(ROW_TINY))
    return xq, row_s


def _attn_input(g: GraphBuilder, h: str, lq: LayerQ) -> str | None:
    """attn_in's u8 input RMSNorm(h) at its static scale as one of hetero's ops (`native.ort_ops`), where the layer's
    attn_in is 8-bit at a static scale with no online transform; else None (the nodes). A shadow: the caller keeps
    the nodes."""
    x = lq.qkv[0]
    if x.x_bits != 8 or x.x_per_row or "attn_in" in dict(lq.online) or lq.hidden % 16:
        return None
    return g.op(ort_ops.RMS_NORM_QUANT, [h, g.const(lq.attn_norm.astype(np.float32), "norm_w")], "xq",
                domain=ort_ops.DOMAIN, eps=float(lq.eps), scale=float(np.float32(x.x_scale)))


def _ffn_input(g: GraphBuilder, h: str, o: str, lq: LayerQ) -> tuple[str, str] | None:
    """(h1, xq): the residual h + o and ffn_in's u8 input RMSNorm(h1) at its static scale as one of hetero's ops
    (`native.ort_ops`), where the layer's ffn_in is 8-bit at a static scale with no online transform and the layer
    has no post-attention norm; else None (the nodes). A shadow: the caller keeps the nodes."""
    x = lq.gate_up[0]
    if x.x_bits != 8 or x.x_per_row or lq.post_attn_norm is not None or "ffn_in" in dict(lq.online) or lq.hidden % 16:
        return None
    h1, xq = g.op_n(ort_ops.ADD_RMS_NORM_QUANT, [h, o, g.const(lq.ffn_norm.astype(np.float32), "norm_w")],
                    [Buffer.H1, "xq"], domain=ort_ops.DOMAIN, eps=float(lq.eps), scale=float(np.float32(x.x_scale)))
    return h1, xq


def _fused_down_input(lq: LayerQ, block: int | None, shadowed: bool) -> bool:
    """Whether `_down_input` (SiLU·up, the Hadamard and u8 quantization in one op) computes this layer's down_in."""
    return (lq.act == "silu" and block == ort_ops.BLOCK and lq.down.x_bits == 8 and not shadowed
            and lq.ffn % ort_ops.BLOCK == 0)


def _rotated_input(g: GraphBuilder, x: str, lin: LinearQ, block: int | None, width: int) -> tuple[str, str] | None:
    """A rotated site's quantized input x·T as one of hetero's ops (`native.ort_ops`): (xq, None) at 8 bits, (xq,
    row_s) at 8 bits with a scale per row, (u_hi, u_lo) at 16 (`_linears`' `quantized`), where the site has the op's
    64-block transform; else None (the nodes). A shadow: the caller keeps the nodes."""
    from hetero.outliers.rowscale import ROW_QMAX, ROW_TINY

    if block != ort_ops.BLOCK or lin.x_bits not in (8, 16) or width % block:
        return None
    if lin.x_per_row:
        xq, row_s = g.op_n(ort_ops.HADAMARD_ROW_QUANT, [x], ["xq", "row_s"], domain=ort_ops.DOMAIN,
                           block=ort_ops.BLOCK, scale=0.0, qmax=float(ROW_QMAX), tiny=float(ROW_TINY))
        return xq, row_s
    attrs = dict(domain=ort_ops.DOMAIN, block=ort_ops.BLOCK, scale=float(np.float32(lin.x_scale)))
    if lin.x_bits == 8:
        return g.op(ort_ops.HADAMARD_QUANT, [x], "xq", **attrs), None
    u_hi, u_lo = g.op_n(ort_ops.HADAMARD_QUANT16, [x], ["u_hi", "u_lo"], **attrs)
    return u_hi, u_lo


def _attention(g: GraphBuilder, qkv: str, attn: AttnSpec, lq: LayerQ) -> str:
    """The chunk's attention over the KV cache (`attention.gqa_node`, as `attention.ChunkAttention` runs it):
    packed q|k|v [T, ·] → [T, q_dim], this chunk's K/V written into the cache inputs in place."""
    d, f, i32 = lq.q_dim // attn.n_heads, TensorProto.FLOAT, TensorProto.INT32
    for name in GQA_INPUTS[:2]:
        g.input(name, [1, attn.n_kv_heads, "capacity", d])
    g.input(GQA_INPUTS[2], [1], i32)
    g.input(GQA_INPUTS[3], [], i32)
    for name in GQA_INPUTS[4:]:
        g.input(name, ["positions", "half_rotary"], f)
    q3 = g.op("Unsqueeze", [qkv, g.const(np.array([0], np.int64))], "qkv3")
    out = g.fresh("attn")
    g.nodes.append(gqa_node(attn.n_heads, attn.n_kv_heads, attn.scale, attn.window, q3, out, out + "_gqa"))
    g.domains.add("com.microsoft")
    return g.op("Squeeze", [out, g.const(np.array([0], np.int64))], "a")


def build_segment(spec: SegmentSpec, lq: LayerQ) -> onnx.ModelProto:
    """The ONNX graph of one segment (pure function of its spec and parameters)."""
    g = GraphBuilder(f"L{spec.layer}_{spec.kind}_C{spec.chunk}_{spec.flavor}")
    ins, outs = segment_io(spec, lq)
    ab = shape_rows(spec.shape, spec.chunk)
    rows: int | str = spec.chunk or "T"  # DYNAMIC_ROWS: a symbolic row count
    conv = spec.shape.startswith("conv:")
    env: dict[str, str] = {}
    for name, width in ins.items():
        t = g.input(name, [rows, width])
        env[name] = g.op("Reshape", [t, g.const(np.array([ab[0], ab[1], width], np.int64))]) if ab else t
    f, k = spec.flavor, cpu_kernel(lq.weight_form)
    blocks = dict(lq.online)
    sh = set(spec.shadows)

    def online(site: str, x: str, width: int) -> str:  # x·T in front of a rotated site's quantization
        return online_hadamard(g, x, list(ab or (spec.chunk,)), width, blocks[site]) if site in blocks else x

    B = Buffer
    for piece in spec.pieces:
        if piece == "qkv" and spec.native_ops and "attn_in" not in sh and (xq := _attn_input(g, env[B.H], lq)):
            env[B.QKV] = _linears(g, None, list(lq.qkv), f, kernel=k, quantized=(xq, None))
        elif piece == "qkv":
            env[B.X] = rms_norm(g, env[B.H], lq.attn_norm, lq.eps, f)
            q = spec.native_ops and "attn_in" not in sh and \
                _rotated_input(g, env[B.X], lq.qkv[0], blocks.get("attn_in"), lq.hidden)
            if q:
                env[B.QKV] = _linears(g, None, list(lq.qkv), f, kernel=k, quantized=q)
            else:
                env[B.QKV] = _linears(g, online("attn_in", env[B.X], lq.hidden), list(lq.qkv), f, conv=conv, kernel=k,
                                      shadow="attn_in" in sh)
        elif piece == "attn":
            env[B.A] = _attention(g, env[B.QKV], spec.attn, lq)
        elif piece == "o":
            env[B.X] = env[B.A]
            a = env[B.A] if spec.a_rotated else online("o_in", env[B.A], lq.q_dim)  # (rotated by the attention kernel)
            env[B.O] = _linears(g, a, [lq.o], f, conv=conv, kernel=k, shadow="o_in" in sh)
        elif piece == "gu" and spec.native_ops and "ffn_in" not in sh and (fused := _ffn_input(g, env[B.H], env[B.O], lq)):
            env[B.H1], xq = fused  # (gate and up apart: `spec.in_graph`)
            env["gate"], env["up"] = (_linears(g, None, [lin], f, kernel=k, quantized=(xq, None)) for lin in lq.gate_up)
        elif piece == "gu":
            o = env[B.O] if lq.post_attn_norm is None else rms_norm(g, env[B.O], lq.post_attn_norm, lq.eps, f)
            env[B.H1] = g.op("Add", [env[B.H], o], B.H1)
            env[B.X] = rms_norm(g, env[B.H1], lq.ffn_norm, lq.eps, f)
            q = spec.native_ops and "ffn_in" not in sh and \
                _rotated_input(g, env[B.X], lq.gate_up[0], blocks.get("ffn_in"), lq.hidden)
            if q:  # (gate and up apart: `spec.in_graph`)
                env["gate"], env["up"] = (_linears(g, None, [lin], f, kernel=k, quantized=q) for lin in lq.gate_up)
            elif spec.in_graph:  # gate and up apart: no Split of a [T, 2·ffn] product (8% of a layer's kernels)
                x = online("ffn_in", env[B.X], lq.hidden)
                env["gate"], env["up"] = (_linears(g, x, [lin], f, kernel=k, shadow="ffn_in" in sh)
                                          for lin in lq.gate_up)
            else:
                x = online("ffn_in", env[B.X], lq.hidden)
                env[B.GU] = _linears(g, x, list(lq.gate_up), f, conv=conv, kernel=k, shadow="ffn_in" in sh)
        elif piece == "act" and spec.native_ops and \
                _fused_down_input(lq, blocks.get("down_in"), "down_in" in sh):  # (gate and up apart: `spec.in_graph`)
            env["down_q"] = _down_input(g, env["gate"], env["up"], lq, blocks.get("down_in"), "down_in" in sh)
        elif piece == "act":
            if "gate" in env:
                gate, up = env["gate"], env["up"]
            else:
                gate = slice_last(g, env[B.GU], 0, lq.ffn)
                up = slice_last(g, env[B.GU], lq.ffn, 2 * lq.ffn)
            env[B.M] = g.op("Mul", [activation(g, gate, lq.act), up], B.M)
        elif piece == "down" and "down_q" in env and lq.down.x_per_row and lq.down.bias is None \
                and lq.post_ffn_norm is None and B.H1 in env:  # h_out = h1 + (xq·W)·row_s in one of hetero's ops
            xq, row_s = env["down_q"]
            y = _linears(g, None, [lq.down], f, kernel=k, quantized=(xq, None))
            env[B.H_OUT] = g.op(ort_ops.SCALE_ADD, [y, row_s, env[B.H1]], B.H_OUT, domain=ort_ops.DOMAIN)
        elif piece == "down":
            q = env.get("down_q") or (spec.native_ops and "down_in" not in sh and
                                      _rotated_input(g, env[B.M], lq.down, blocks.get("down_in"), lq.ffn))
            env[B.D] = (_linears(g, None, [lq.down], f, kernel=k, quantized=q) if q else
                        _linears(g, online("down_in", env[B.M], lq.ffn), [lq.down], f, conv=conv, kernel=k,
                                 shadow="down_in" in sh))
            if B.H1 in env:  # (a separate down graph's caller adds h1 + post-norm(d + shadow): `LayerProgram.finish`)
                d = env[B.D] if lq.post_ffn_norm is None else rms_norm(g, env[B.D], lq.post_ffn_norm, lq.eps, f)
                env[B.H_OUT] = g.op("Add", [env[B.H1], d], B.H_OUT)
    if spec.attn is not None:  # the KV cache rows the attention node writes in place
        for name in GQA_OUTPUTS:
            g.output(None, name, [1, spec.attn.n_kv_heads, "capacity", lq.q_dim // spec.attn.n_heads])
    for name, width in outs.items():
        src = env[name]
        if ab:
            src = g.op("Reshape", [src, g.const(np.array([spec.chunk, width], np.int64))])
        g.output(src, name, [rows, width])
    return g.model()


def save_onnx(m: onnx.ModelProto, path: Path, external_min_bytes: int = 1 << 16) -> None:
    """Write `m` to `path`, large initializers as external data in `<stem>.data` beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    big = sum(t.ByteSize() for t in m.graph.initializer) > external_min_bytes
    if big:
        onnx.save_model(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.stem + ".data", size_threshold=1024)
    else:
        onnx.save_model(m, str(path))
