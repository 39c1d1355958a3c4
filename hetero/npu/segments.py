"""Segments: how a layer's static work is cut into fixed-shape graphs, and the parameters they hold.

A segment is one graph of shape [C, ·] shared by every chunk (mllm-NPU §3.2). Cuts follow the plan's
shadow sites: a shadow correction (Eq. 1) is added on the CPU right after the linear it corrects, before
the next non-linear op (docs/design.md, "NPU graphs"). Pieces: "o", "gu", "act", "down"; a segment's kind
joins them ("o_ffn" when it holds all four, "o_up" for o+gu+act).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from hetero.errors import ConfigError
from hetero.weights import SITES
from hetero.outliers.quantize import W_QMAX

class Buffer(StrEnum):
    """The tensors a layer's graphs pass between them and the CPU, every one [C, width] float32: the one definition
    of their names (ONNX inputs/outputs of `export.build_segment`, buffers of `NpuBackend` and `decode.bound_step`)."""

    H = "h"  # the layer's input hidden state [C, hidden]
    QKV = "qkv"  # q | k | v [C, q_dim + 2·kv_dim]
    X = "x"  # a normed linear input emitted for its shadow: attn_in's (qkv graph) or ffn_in's (a graph ending at gu)
    A = "a"  # attention's output [C, q_dim]: o_in
    O = "o"  # o_proj's output [C, hidden]
    H1 = "h1"  # the residual after attention [C, hidden]
    GU = "gu"  # gate | up [C, 2·ffn]
    M = "m"  # SiLU(gate)·up [C, ffn]: down_in
    D = "d"  # down_proj's output of a separate down graph, before the residual [C, hidden]
    H_OUT = "h_out"  # the layer's output hidden state [C, hidden]


@dataclass(frozen=True, slots=True)
class AttnSpec:
    """The attention of a whole-layer graph: one `attention.gqa_node` over the KV cache, as `ChunkAttention` runs it."""

    n_heads: int
    n_kv_heads: int
    scale: float
    window: int = 0  # the layer's sliding window (0: none)

    @classmethod
    def of(cls, cfg, layer: int) -> "AttnSpec":
        return cls(cfg.n_heads, cfg.n_kv_heads, float(cfg.scale), cfg.window(layer))


# Versions of what `export` builds of a segment, part of every graph's cache key (here, not in `export`: a warm start
# keys its graphs without importing onnx). Bump EXPORT_VERSION when the graphs' math or I/O change (every key also
# holds the graph builders' source, `cache.builders_digest`: an edit that forgets the bump still gets new keys).
# 4: per-output-channel weight scales. 5: 7-bit weights by default, u8·s8 MatMulInteger on the CPU EP.
# 6: qnn flavour: u8→u16 Convert in front of the MatMul, so HTP really rounds the activation.
# 7: qnn weights dequantized at their largest channel scale; the qnn-fp16 flavour (RMSNorm on x / max|x|).
# 8: the plan's weight form (not the weights' range) picks the CPU EP's kernel (w8-u8s8 with VNNI); W8A16
#    sites (two u8 passes on the CPU EP) and online block Hadamards of rotated sites.
# (Gemma 3's post-norms and online attn_in/ffn_in transforms change only the graphs of models that have them:
#  their parameters are in `layer_digest`, so the version stays.)
EXPORT_VERSION = 8
# Whole-layer graphs (kind "layer", in their keys only: the segments' keys stay as they are). 2: gate, up apart.
# 5: the in-graph shadows take their channels by Compress (3 and 4 named unkept experiments' graphs: never reuse them).
LAYER_VERSION = 5
DYNAMIC_ROWS = 0  # SegmentSpec.chunk of a graph whose row count is symbolic (one session for every chunk length)
FLAVORS = ("cpu", "qnn", "qnn-fp16")  # "qnn-fp16": HTP running float ops in fp16 (SoC lanes, AI Hub)
PIECES = ("o", "gu", "act", "down")
LAYER_PIECES = ("qkv", "attn", *PIECES)  # a whole layer in one graph (kind "layer": `layer_graph`)
# A whole layer as two graphs around an attention that runs outside ONNX Runtime (`layer_halves`), each with its
# shadow corrections inside, as the whole-layer graph: kind → pieces
HALVES = {"layer_qkv": ("qkv",), "layer_o_ffn": PIECES}
IN_GRAPH_KINDS = ("layer", *HALVES)  # the kinds whose shadow corrections (Eq. 1) are computed inside the graph
CUT_AFTER = {"o_in": "o", "ffn_in": "gu", "down_in": "act"}  # shadow site → piece after which we cut


@dataclass(frozen=True, slots=True)
class SegmentSpec:
    """One static graph of one layer: which pieces, which extra outputs, shape and flavour."""

    layer: int
    kind: str  # "qkv" | "o_ffn" | a join of PIECES ("o", "gu+act+down", ...)
    pieces: tuple[str, ...]  # ("qkv",) or a contiguous run of PIECES
    chunk: int  # C: rows of every input/output; DYNAMIC_ROWS: any rows, given at run time (CPU EP)
    flavor: str  # "cpu" | "qnn" | "qnn-fp16"
    shape: str = "2d"  # "2d" | "3d:a" | "conv:a" (equivalent shape, §4)
    emit_x: bool = False  # also output the quantized linear's float input (for its shadow on the CPU)
    attn: AttnSpec | None = None  # kind "layer": its attention node
    shadows: tuple[str, ...] = ()  # IN_GRAPH_KINDS: the sites whose shadow correction (Eq. 1) the graph computes
    # kind "layer_o_ffn": its input `a` comes with o_in's online Hadamard applied (by `native.attention`, on V's rows)
    a_rotated: bool = False
    # a layer's halves: their float glue as hetero's own ONNX Runtime ops (`native.ort_ops`) instead of nodes (o→FFN:
    # down_in's input, SiLU·up, its online Hadamard and u8 quantization, a dozen nodes; q|k|v: RMSNorm and attn_in's)
    native_ops: bool = False

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ConfigError(f"flavor must be one of {FLAVORS}, got {self.flavor!r}")
        if (self.kind == "layer") != (self.attn is not None) or (self.shadows and not self.in_graph):
            raise ConfigError(f"only a whole-layer graph (kind 'layer') has an attention node, and only it and its "
                              f"halves {tuple(HALVES)} in-graph shadows, got kind {self.kind!r}")
        if self.a_rotated and self.kind != "layer_o_ffn":
            raise ConfigError(f"only a layer_o_ffn half takes a rotated attention output, got kind {self.kind!r}")
        if self.native_ops and self.kind not in HALVES:
            raise ConfigError(f"only a layer's halves {tuple(HALVES)} hold hetero's own ops, got kind {self.kind!r}")
        pieces = LAYER_PIECES if self.kind == "layer" else HALVES.get(self.kind)
        if self.in_graph and (self.flavor != "cpu" or self.shape != "2d" or self.pieces != pieces):
            raise ConfigError(f"a whole-layer graph or half runs on the CPU EP (flavor 'cpu', shape '2d', its pieces "
                              f"{pieces}), got {self.flavor!r}, {self.shape!r}, {self.pieces}")
        if self.chunk < 0:
            raise ConfigError(f"chunk must be > 0 (or DYNAMIC_ROWS), got {self.chunk}")
        if self.chunk == DYNAMIC_ROWS and self.shape != "2d":
            raise ConfigError(f"a graph with dynamic rows must have shape '2d', got {self.shape!r}")
        shape_rows(self.shape, self.chunk)  # validates

    @property
    def in_graph(self) -> bool:
        """A whole layer or one of its halves: shadows inside, gate and up apart, any row count."""
        return self.kind in IN_GRAPH_KINDS


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
    """The graphs of one layer given which of its sites keep a shadow (module docstring)."""
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


def layer_graph(layer: int, shadow_sites: set[str], attn: AttnSpec) -> SegmentSpec:
    """The one graph of a whole layer (qkv → attention over the KV cache → o → FFN), its shadow corrections inside:
    a chunk's layer in one ONNX Runtime run on every core, where the "NPU" is the CPU itself (`placement`)."""
    return SegmentSpec(layer, "layer", LAYER_PIECES, DYNAMIC_ROWS, "cpu", "2d", False, attn,
                       tuple(s for s in SITES if s in shadow_sites))


@dataclass(frozen=True, slots=True)
class LinearQ:
    """What one quantized linear needs: INT8 weight [out, in], its scale(s), its input site's scale, bias."""

    q: np.ndarray  # int8 [out, in]
    w_scale: float | np.ndarray  # s_w: a float (per tensor) or float32 [out] (per output channel)
    x_scale: float
    bias: np.ndarray | None = None  # float32 [out]
    x_bits: int = 8  # the input site's activation bits: 8, or 16 (W8A16, `site_ops`)
    x_per_row: bool = False  # 8-bit with a scale per row found at run time (`outliers.rowscale`)


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
    weight_form: str = "w8-u8u8"  # the plan's weight form: the CPU EP's kernel (`export.cpu_kernel`); in the digest
    online: tuple[tuple[str, int], ...] = ()  # (site, Hadamard block) of the plan's online transforms
    act: str = "silu"  # the gate's activation (`config.ACTIVATIONS`); in the digest
    post_attn_norm: np.ndarray | None = None  # Gemma 3's post-norms of o and down, before their residual adds
    post_ffn_norm: np.ndarray | None = None


def layer_halves(layer: int, shadow_sites: set[str], a_rotated: bool = False,
                 native_ops: tuple[str, ...] = ()) -> list[SegmentSpec]:
    """A whole layer as two graphs, qkv (RMSNorm, q|k|v) and o → FFN, each with its shadow corrections inside: the
    whole-layer graph (`layer_graph`) less its attention node, for an attention kernel outside ONNX Runtime
    (`native.attention`: BF16 dot products). a_rotated: that kernel applies o_in's online Hadamard;
    native_ops: the kinds whose float glue is hetero's own ops (`native.ort_ops`)."""
    return [SegmentSpec(layer, kind, pieces, DYNAMIC_ROWS, "cpu", "2d", False, None,
                        tuple(s for s in SITES if s in shadow_sites and (s == "attn_in") == (kind == "layer_qkv")),
                        a_rotated and kind == "layer_o_ffn", kind in native_ops)
            for kind, pieces in HALVES.items()]


def segment_io(spec: SegmentSpec, lq: LayerQ) -> tuple[dict[Buffer, int], dict[Buffer, int]]:
    """Input and output buffers of a segment → their width (every tensor is [C, width] float32)."""
    p = spec.pieces
    if spec.kind == "layer":  # and the KV cache, RoPE tables and lengths of its attention (`attention.GQA_INPUTS`)
        return {Buffer.H: lq.hidden}, {Buffer.H_OUT: lq.hidden}
    if p == ("qkv",):
        outs = {Buffer.QKV: lq.q_dim + 2 * lq.kv_dim}
        if spec.emit_x:
            outs[Buffer.X] = lq.hidden
        return {Buffer.H: lq.hidden}, outs
    ins: dict[Buffer, int] = {}
    first = p[0]
    if first == "o":
        ins[Buffer.A] = lq.q_dim
    elif first == "gu":
        ins[Buffer.O] = lq.hidden
    elif first == "act":
        ins[Buffer.GU] = 2 * lq.ffn
    elif first == "down":
        ins[Buffer.M] = lq.ffn
    if "gu" in p:
        ins[Buffer.H] = lq.hidden
    elif first == "act" and "down" in p:  # the residual add h1 + d
        ins[Buffer.H1] = lq.hidden
    last = p[-1]
    if p == ("down",):  # its shadow is added before the residual, as the reference: h1 + (d + shadow)
        outs = {Buffer.D: lq.hidden}
    elif last == "down":
        outs = {Buffer.H_OUT: lq.hidden}
    elif last == "o":
        outs = {Buffer.O: lq.hidden}
    elif last == "gu":
        outs = {Buffer.GU: 2 * lq.ffn, Buffer.H1: lq.hidden}
        if spec.emit_x:
            outs[Buffer.X] = lq.hidden
    elif first == "act":  # a lone act (cut after gu and after act): h1 stays where gu put it
        outs = {Buffer.M: lq.ffn}
    else:  # ... → act
        outs = {Buffer.M: lq.ffn, Buffer.H1: lq.hidden}
    return ins, outs


def layer_q(cfg, arrays: dict[str, np.ndarray], plan, layer: int) -> LayerQ:
    """Collect one layer's parameters from the model's float weights at rest (`loader.Model.arrays`: numpy, so a
    warm start reads its norms and biases without torch) and a `QuantPlan` (duck-typed)."""
    s = {site: plan.sites[(layer, site)].scale for site in SITES}

    def f32(name: str) -> np.ndarray | None:
        a = arrays.get(f"layers.{layer}.{name}")
        return None if a is None else np.asarray(a, dtype=np.float32)

    def lin(name: str, site: str, bias: str) -> LinearQ:
        w = plan.weights[(layer, name)]
        ws = w.scales.astype(np.float32) if hasattr(w, "scales") else float(w.scale)  # per channel / per tensor
        sq = plan.sites[(layer, site)]
        return LinearQ(w.q, ws, float(s[site]), f32(bias), sq.bits, sq.per_row)

    return LayerQ(
        cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.ffn, float(cfg.rms_eps), f32("attn_norm"), f32("ffn_norm"),
        (lin("wq", "attn_in", "bq"), lin("wk", "attn_in", "bk"), lin("wv", "attn_in", "bv")),
        lin("wo", "o_in", "bo"), (lin("w_gate", "ffn_in", "b_gate"), lin("w_up", "ffn_in", "b_up")),
        lin("w_down", "down_in", "b_down"),
        int(plan.weight_qmax), plan.weight_form, tuple(sorted(plan.online.items())), cfg.act,
        f32("post_attn_norm") if cfg.post_norms else None, f32("post_ffn_norm") if cfg.post_norms else None,
    )


def layer_digest(lq: LayerQ) -> str:
    """Content hash of one layer's graph parameters (cheap: weights are sampled, scales exact).

    The model fingerprint (hash of the model file) goes into the cache key beside this; sampling the
    INT8 weights keeps the key cheap to compute at load time while catching a different plan/model.
    """
    h = hashlib.sha256()
    meta = [lq.hidden, lq.q_dim, lq.kv_dim, lq.ffn, lq.eps, lq.weight_qmax, lq.weight_form, list(lq.online)]
    if lq.act != "silu":  # (the plain layer's digest, and so its cached graphs, unchanged)
        meta.append(lq.act)
    for lin in (*lq.qkv, lq.o, *lq.gate_up, lq.down):
        ws = np.asarray(lin.w_scale, np.float32)
        meta += [float(ws) if ws.ndim == 0 else "channel", lin.x_scale, list(lin.q.shape), lin.x_bits]
        if lin.x_per_row:  # (a site without it: the digest, and so its cached graphs, unchanged)
            meta.append("per_row")
        if ws.ndim:
            h.update(ws.tobytes())
        flat = lin.q.reshape(-1)
        h.update(flat[:: max(1, flat.size // 4096)].tobytes())
        h.update(flat[-64:].tobytes())
        if lin.bias is not None:
            h.update(lin.bias.tobytes())
    h.update(lq.attn_norm.tobytes())
    h.update(lq.ffn_norm.tobytes())
    for post in (lq.post_attn_norm, lq.post_ffn_norm):  # (absent: the plain layer's digest unchanged)
        if post is not None:
            h.update(b"post" + post.tobytes())
    h.update(json.dumps(meta).encode())
    return h.hexdigest()[:24]
