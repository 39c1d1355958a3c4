"""Export the static subgraphs of a decoder layer as fixed-shape INT8 ONNX graphs (mllm-NPU §3.2).

A layer's static work is cut into *segments*; a segment is one ONNX graph of fixed shape [C, ·]
shared by every chunk (the chunk-sharing graph). The cuts follow the shadow sites of the quantization
plan, because a shadow outlier correction (Eq. 1) must be added on the CPU right after the linear
whose input it corrects, before the next non-linear op:

    qkv    : h ─► RMSNorm ─► [attn_in] Q|K|V ─► qkv            (+ x_attn out when attn_in has a shadow)
    o_ffn  : a ─► [o_in] O ─┤cut if o_in shadow├─► +h ─► RMSNorm ─► [ffn_in] gate|up ─┤cut if ffn_in├─►
             SiLU·mul ─┤cut if down_in├─► [down_in] down ─► +h

so a layer without shadows has two graphs (`qkv`, `o_ffn`) and one whose `down_in` keeps a shadow has
`qkv`, `o_up` (= o, gu, act: emits the float FFN intermediate) and `down`. Piece names: "o", "gu",
"act", "down"; a segment's kind joins them ("o_ffn" when it holds all four).

Two flavours of the same math:
- "cpu" (ONNX Runtime CPU EP): QuantizeLinear(u8, zp 128) → MatMulInteger(u8 zp 128, s8 weights zp 0
  [K, N]) → Cast → Mul(s_x·s_w), or u8·u8 (weights stored q + 128, zp 128), as the plan's weight form
  says (`cpu_kernel`, `hetero.npu.isa`): u8·s8 with 8-bit weights is exact only with VNNI (AVX2 without
  VNNI saturates its int16 pair sums unless |q| <= 64: `constraints.CPU_EP_CONSTRAINTS`).
  Bit-exact with `hetero.outliers.quantize.int8_linear` (int32 accumulation, half-to-even rounding, one
  float32 scale multiply per output column). Linears sharing an input (Q/K/V, gate/up) are one
  MatMulInteger over concatenated weights, scaled per column by the same float32 products.
- "qnn" / "qnn-fp16" (HTP; the latter where HTP runs float ops in fp16, `_rms_norm`):
  QuantizeLinear/DequantizeLinear(u8, zp 128) on the activation, then the same grid in u16
  (QuantizeLinear/DequantizeLinear u16, zp 32768: a u8→u16 Convert on HTP), and DequantizeLinear(s8, zp 0)
  on each weight around a MatMul, one MatMul per linear (`constraints.QNN_NOT_YET`). The QNN EP of
  onnxruntime-qnn 2.7 keeps that MatMul in float (it fuses a quantized FullyConnected only when a
  QuantizeLinear of the activation's bit width follows the MatMul, which would requantize the output to
  8 bits: `constraints.QNN_CONSTRAINTS["no_int32_matmul_output"]`): the simulator computes the INT8
  reference's products exactly (integer-valued operands, fp32), a device would run them at its float
  precision.

Weights are per output channel by default (`quantize` module doc): their scales are static, so they fold
into the output dequantization. The integer MatMul is the same as per tensor; only the multiply after
it takes a float32 vector s_x·s_w[col] [N] instead of a scalar (on the QDQ form: DequantizeLinear of
the weight with per-axis scales, axis=1 = the output dim of the [K, N] weight, `QNN_PER_AXIS_DQ`; the
onnxruntime-qnn 2.7.0 simulator rejects that node, so by default the weight is dequantized per tensor at
its largest channel scale and the MatMul is followed by Mul(s_w[col] / max s_w)). The activations, the NPU's constraint (§2.3/§3.3), stay
per tensor. Per-tensor weights (the paper's strict variant) give a
constant vector, emitted as one scalar.
  RMSNorm, residual adds and SiLU·mul stay float ops inside the graph; the simulator runs them on HTP.

Equivalent shapes (§4, `shapes.py`): shape "2d" runs the graph on [C, K]; "3d:a" reshapes the input to
[a, C/a, K] once at the graph's entry (every op is row-wise) and back at its exit; "conv:a" does the same
and runs every linear as a 1×1 Conv2d over the NCHW image [1, K, a, C/a] (weight [N, K, 1, 1];
ConvInteger on the CPU EP, bit-identical to MatMulInteger; a QDQ Conv on HTP, whose NHWC layout makes the
transposes around it cancel).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from hetero.errors import ConfigError
from hetero.outliers.quantize import ACT_ZERO_POINT, W_QMAX, WEIGHT_FORMS, check_weight_form

# Bump when the graphs' math or I/O change: part of every cache key.
# 4: per-output-channel weight scales. 5: 7-bit weights by default, u8·s8 MatMulInteger on the CPU EP.
# 6: qnn flavour: u8→u16 Convert in front of the MatMul, so HTP really rounds the activation.
# 7: qnn weights dequantized at their largest channel scale; the qnn-fp16 flavour (RMSNorm on x / max|x|).
# 8: the plan's weight form (not the weights' range) picks the CPU EP's kernel (w8-u8s8 with VNNI).
EXPORT_VERSION = 8
ACT_ZERO_POINT_U16 = 32768
OPSET = 21
FLAVORS = ("cpu", "qnn", "qnn-fp16")
PIECES = ("o", "gu", "act", "down")
CUT_AFTER = {"o_in": "o", "ffn_in": "gu", "down_in": "act"}  # shadow site → piece after which we cut


@dataclass(frozen=True, slots=True)
class SegmentSpec:
    """One static graph of one layer: which pieces, which extra outputs, shape and flavour."""

    layer: int
    kind: str  # "qkv" | "o_ffn" | a join of PIECES ("o", "gu+act+down", ...)
    pieces: tuple[str, ...]  # ("qkv",) or a contiguous run of PIECES
    chunk: int  # C: rows of every input/output
    flavor: str  # "cpu" | "qnn" | "qnn-fp16"
    shape: str = "2d"  # "2d" | "3d:a" | "conv:a" (equivalent shape, §4)
    emit_x: bool = False  # also output the quantized linear's float input (for its shadow on the CPU)

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ConfigError(f"flavor must be one of {FLAVORS}, got {self.flavor!r}")
        if self.chunk <= 0:
            raise ConfigError(f"chunk must be > 0, got {self.chunk}")
        shape_rows(self.shape, self.chunk)  # validates


def shape_rows(shape: str, chunk: int) -> tuple[int, int] | None:
    """(a, b) with a·b = C for "3d:a" and "conv:a", None for "2d"; ConfigError for anything else."""
    if shape == "2d":
        return None
    form, _, a_txt = shape.partition(":")
    if form in ("3d", "conv") and a_txt.isdigit():
        a = int(a_txt)
        if a > 0 and chunk % a == 0:
            return a, chunk // a
    raise ConfigError(f"shape must be '2d', '3d:a' or 'conv:a' with a dividing C={chunk}, got {shape!r}")


def layer_segments(layer: int, shadow_sites: set[str], chunk: int, flavor: str, shape: str = "2d") -> list[SegmentSpec]:
    """The graphs of one layer given which of its sites keep a shadow (see the module docstring)."""
    segs = [SegmentSpec(layer, "qkv", ("qkv",), chunk, flavor, shape, "attn_in" in shadow_sites)]
    cuts = {CUT_AFTER[s] for s in shadow_sites if s in CUT_AFTER}
    run: list[str] = []
    for piece in PIECES:
        run.append(piece)
        if piece in cuts or piece == "down":
            kind = "o_ffn" if len(run) == 4 else ("o_up" if run == ["o", "gu", "act"] else "+".join(run))
            emit = piece == "gu" and piece in cuts  # the ffn_in input x (o_in's input `a` is already on the CPU)
            segs.append(SegmentSpec(layer, kind, tuple(run), chunk, flavor, shape, emit))
            run = []
    return segs


# ---------------------------------------------------------------------------------------- builder


class _Graph:
    """A tiny ONNX graph builder with deterministic names (ORT quantization tool style)."""

    def __init__(self, name: str):
        self.name, self.nodes, self.inits, self.inputs, self.outputs = name, [], [], [], []
        self._n = 0
        self._consts: dict[bytes, str] = {}

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

    def op(self, op_type: str, inputs: list[str], stem: str | None = None, **attrs) -> str:
        out = self.fresh(stem or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out + "_" + op_type, **attrs))
        return out

    def input(self, name: str, shape: list[int]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        return name

    def output(self, src: str, name: str, shape: list[int]) -> None:
        self.nodes.append(helper.make_node("Identity", [src], [name], name=name + "_out"))
        self.outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))

    def model(self) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="hetero.npu")
        m.ir_version = 10
        return m


@dataclass(frozen=True, slots=True)
class LinearQ:
    """What one quantized linear needs: INT8 weight [out, in], its scale(s), its input site's scale, bias."""

    q: np.ndarray  # int8 [out, in]
    w_scale: float | np.ndarray  # s_w: a float (per tensor) or float32 [out] (per output channel)
    x_scale: float
    bias: np.ndarray | None = None  # float32 [out]


def _rms_norm(g: _Graph, x: str, w: np.ndarray, eps: float, flavor: str) -> str:
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
    results) but 2·255·64 = 32640 <= 32767 (exact). With a VNNI dot product (`hetero.npu.isa`) u8·s8 is
    exact for 8-bit weights too ("w8-u8s8"). 7-bit weights ("w7-u8s8", ORT's reduce_range) run u8·s8
    everywhere; 8-bit weights on AVX2 run u8·u8 ("w8-u8u8": stored q + 128 with zero point 128, vpmaddwd:
    exact, same int32 result), slower there: 256×576×1536 at 1 thread, 136 vs 178 GOPS; a whole C=256
    layer (qkv + o_ffn) of the default model 14.8 vs 11.5 ms at 1 thread, 18.8 vs 11.6 ms at 2 (an AVX2
    EPYC, onnxruntime 1.31). The saturation reproduces only on AVX2 without VNNI.
    """
    return WEIGHT_FORMS[check_weight_form(weight_form)].kernel


def _conv_in(g: _Graph, x: str) -> str:
    """[a, b, K] → [1, K, a, b] (NCHW) for a 1×1 Conv (on the CPU EP the moved tensor is the u8 activation)."""
    return g.op("Unsqueeze", [g.op("Transpose", [x], "nchw", perm=[2, 0, 1]), g.const(np.array([0], np.int64))])


def _conv_out(g: _Graph, y: str) -> str:
    """[1, N, a, b] → [a, b, N]."""
    return g.op("Transpose", [g.op("Squeeze", [y, g.const(np.array([0], np.int64))])], "rows", perm=[1, 2, 0])


def _weight(g: _Graph, w_kn: np.ndarray, conv: bool, stem: str = "w_q") -> str:
    """A weight given as [K, N], stored for MatMul ([K, N]) or for a 1×1 Conv ([N, K, 1, 1])."""
    return g.const(np.ascontiguousarray(w_kn.T)[:, :, None, None] if conv else np.ascontiguousarray(w_kn), stem)


def _product(g: _Graph, op: str, x: str, w: str, extra: list[str], conv: bool) -> str:
    """x @ W: `op` (MatMul / MatMulInteger) over rows, or its 1×1 Conv (Conv / ConvInteger) over x laid
    out NCHW (§4 equivalent shape "conv:a"); `w` stored by `_weight`."""
    if not conv:
        return g.op(op, [x, w, *extra], "y")
    conv_op = {"MatMul": "Conv", "MatMulInteger": "ConvInteger"}[op]
    return _conv_out(g, g.op(conv_op, [_conv_in(g, x), w, *extra], "acc"))


def _linears(g: _Graph, x: str, lins: list[LinearQ], flavor: str, qnn_per_axis: bool | None = None,
             conv: bool = False, kernel: str = "u8s8") -> str:
    """y = concat_j(int8_linear(x, s_x, W_j) + b_j) along the last axis; all lins share x and s_x.

    conv: x is [a, b, K] and each matmul runs as a 1×1 Conv over [1, K, a, b] (bit-identical on the CPU EP:
    ConvInteger accumulates the same int32 products). kernel: the CPU EP's `cpu_kernel` of the plan.
    """
    qnn_per_axis = QNN_PER_AXIS_DQ if qnn_per_axis is None else qnn_per_axis
    s_x = np.float32(lins[0].x_scale)
    assert all(np.float32(lq.x_scale) == s_x for lq in lins), "fused linears must share their input site"
    zp = g.const(np.array(ACT_ZERO_POINT, np.uint8), "act_zp")
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
        acc = _product(g, "MatMulInteger", xq, _weight(g, wt, conv), [zp, w_zp], conv)
        s = scales[:1] if np.all(scales == scales[0]) else scales
        y = g.op("Mul", [g.op("Cast", [acc], to=TensorProto.FLOAT), g.const(s, "acc_s")], "y")
    else:
        s_xc = g.const(np.array(s_x, np.float32), "act_s")
        xd = g.op("DequantizeLinear", [xq, s_xc, zp], "xd")
        # The u8 grid re-expressed in u16 (same scale, zp 32768): the QNN EP turns this DQ→Q pair into a u8→u16
        # Convert, which keeps the u8 Quantize a real rounding op; without it the EP makes the Q→DQ pair on x
        # standalone ops that HTP folds away, and x reaches the MatMul unrounded (`constraints.QNN_CONSTRAINTS`).
        zp16 = g.const(np.array(ACT_ZERO_POINT_U16, np.uint16), "act_zp16")
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
    if has_bias:
        b = np.concatenate([lq.bias if lq.bias is not None else np.zeros(lq.q.shape[0], np.float32) for lq in lins])
        y = g.op("Add", [y, g.const(b.astype(np.float32), "bias")])
    return y


def _out_scale(s_x: np.float32, lq: LinearQ) -> np.ndarray:
    """float32 [out]: s_x·s_w (per tensor, repeated) or s_x·s_w[o] (per channel), exactly as
    `quantize.int8_linear` / `int8_linear_per_channel` compute the product (one float32 multiply)."""
    n = lq.q.shape[0]
    if np.ndim(lq.w_scale) == 0:
        return np.full(n, np.float32(s_x) * np.float32(lq.w_scale), np.float32)
    return (np.float32(s_x) * np.asarray(lq.w_scale, np.float32).reshape(n)).astype(np.float32)


def _slice_last(g: _Graph, x: str, start: int, end: int) -> str:
    return g.op("Slice", [x, g.const(np.array([start], np.int64)), g.const(np.array([end], np.int64)),
                          g.const(np.array([-1], np.int64))])


@dataclass(frozen=True, slots=True)
class LayerQ:
    """Float and INT8 parameters of one layer, as the graphs need them."""

    hidden: int
    q_dim: int
    kv_dim: int
    ffn: int
    eps: float
    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    qkv: tuple[LinearQ, LinearQ, LinearQ]
    o: LinearQ
    gate_up: tuple[LinearQ, LinearQ]
    down: LinearQ
    weight_qmax: int = W_QMAX  # the plan's weight range (63 = 7-bit); in the digest
    weight_form: str = "w8-u8u8"  # the plan's weight form: the CPU EP's kernel (`cpu_kernel`); in the digest


def segment_io(spec: SegmentSpec, lq: LayerQ) -> tuple[dict[str, int], dict[str, int]]:
    """Input and output names of a segment → their width (every tensor is [C, width] float32)."""
    p = spec.pieces
    if p == ("qkv",):
        outs = {"qkv": lq.q_dim + 2 * lq.kv_dim}
        if spec.emit_x:
            outs["x"] = lq.hidden
        return {"h": lq.hidden}, outs
    ins: dict[str, int] = {}
    first = p[0]
    if first == "o":
        ins["a"] = lq.q_dim
    elif first == "gu":
        ins["o"] = lq.hidden
    elif first == "act":
        ins["gu"] = 2 * lq.ffn
    elif first == "down":
        ins["m"] = lq.ffn
    if "gu" in p:
        ins["h"] = lq.hidden
    elif first == "act":
        ins["h1"] = lq.hidden
    last = p[-1]
    if p == ("down",):  # its shadow is added before the residual, as the reference: h1 + (d + shadow)
        outs = {"d": lq.hidden}
    elif last == "down":
        outs = {"h_out": lq.hidden}
    elif last == "o":
        outs = {"o": lq.hidden}
    elif last == "gu":
        outs = {"gu": 2 * lq.ffn, "h1": lq.hidden}
        if spec.emit_x:
            outs["x"] = lq.hidden
    else:  # act
        outs = {"m": lq.ffn, "h1": lq.hidden}
    return ins, outs


def build_segment(spec: SegmentSpec, lq: LayerQ) -> onnx.ModelProto:
    """The ONNX graph of one segment (pure function of its spec and parameters)."""
    g = _Graph(f"L{spec.layer}_{spec.kind}_C{spec.chunk}_{spec.flavor}")
    ins, outs = segment_io(spec, lq)
    ab = shape_rows(spec.shape, spec.chunk)
    conv = spec.shape.startswith("conv:")
    env: dict[str, str] = {}
    for name, width in ins.items():
        t = g.input(name, [spec.chunk, width])
        env[name] = g.op("Reshape", [t, g.const(np.array([ab[0], ab[1], width], np.int64))]) if ab else t
    f, k = spec.flavor, cpu_kernel(lq.weight_form)
    for piece in spec.pieces:
        if piece == "qkv":
            env["x"] = _rms_norm(g, env["h"], lq.attn_norm, lq.eps, f)
            env["qkv"] = _linears(g, env["x"], list(lq.qkv), f, conv=conv, kernel=k)
        elif piece == "o":
            env["x"] = env["a"]
            env["o"] = _linears(g, env["a"], [lq.o], f, conv=conv, kernel=k)
        elif piece == "gu":
            env["h1"] = g.op("Add", [env["h"], env["o"]], "h1")
            env["x"] = _rms_norm(g, env["h1"], lq.ffn_norm, lq.eps, f)
            env["gu"] = _linears(g, env["x"], list(lq.gate_up), f, conv=conv, kernel=k)
        elif piece == "act":
            gate = _slice_last(g, env["gu"], 0, lq.ffn)
            up = _slice_last(g, env["gu"], lq.ffn, 2 * lq.ffn)
            silu = g.op("Mul", [gate, g.op("Sigmoid", [gate])], "silu")
            env["m"] = g.op("Mul", [silu, up], "m")
        elif piece == "down":
            env["d"] = _linears(g, env["m"], [lq.down], f, conv=conv, kernel=k)
            if "h1" in env:
                env["h_out"] = g.op("Add", [env["h1"], env["d"]], "h_out")
    for name, width in outs.items():
        src = env[name]
        if ab:
            src = g.op("Reshape", [src, g.const(np.array([spec.chunk, width], np.int64))])
        g.output(src, name, [spec.chunk, width])
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


def layer_q(cfg, lw, plan, layer: int) -> LayerQ:
    """Collect one layer's parameters from the float weights and a `QuantPlan` (duck-typed)."""
    s = {site: plan.sites[(layer, site)].scale for site in ("attn_in", "o_in", "ffn_in", "down_in")}

    def lin(name: str, site: str, bias=None) -> LinearQ:
        w = plan.weights[(layer, name)]
        b = None if bias is None else bias.detach().cpu().numpy().astype(np.float32)
        ws = w.scales.astype(np.float32) if hasattr(w, "scales") else float(w.scale)  # per channel / per tensor
        return LinearQ(w.q, ws, float(s[site]), b)

    return LayerQ(
        cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.ffn, float(cfg.rms_eps),
        lw.attn_norm.detach().cpu().numpy().astype(np.float32), lw.ffn_norm.detach().cpu().numpy().astype(np.float32),
        (lin("wq", "attn_in", lw.bq), lin("wk", "attn_in", lw.bk), lin("wv", "attn_in", lw.bv)),
        lin("wo", "o_in"), (lin("w_gate", "ffn_in"), lin("w_up", "ffn_in")), lin("w_down", "down_in"),
        int(plan.weight_qmax), plan.weight_form,
    )


def layer_digest(lq: LayerQ) -> str:
    """Content hash of one layer's graph parameters (cheap: weights are sampled, scales exact).

    The model fingerprint (hash of the model file) goes into the cache key beside this; sampling the
    INT8 weights keeps the key cheap to compute at load time while catching a different plan/model.
    """
    h = hashlib.sha256()
    meta = [lq.hidden, lq.q_dim, lq.kv_dim, lq.ffn, lq.eps, lq.weight_qmax, lq.weight_form]
    for lin in (*lq.qkv, lq.o, *lq.gate_up, lq.down):
        ws = np.asarray(lin.w_scale, np.float32)
        meta += [float(ws) if ws.ndim == 0 else "channel", lin.x_scale, list(lin.q.shape)]
        if ws.ndim:
            h.update(ws.tobytes())
        flat = lin.q.reshape(-1)
        h.update(flat[:: max(1, flat.size // 4096)].tobytes())
        h.update(flat[-64:].tobytes())
        if lin.bias is not None:
            h.update(lin.bias.tobytes())
    h.update(lq.attn_norm.tobytes())
    h.update(lq.ffn_norm.tobytes())
    h.update(json.dumps(meta).encode())
    return h.hexdigest()[:24]
