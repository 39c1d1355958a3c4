"""Decode graphs whose linears are ONNX Runtime's `MatMulNBits` (block-quantized weights, int8 activations per block).

A plain decode step is one row against every weight: its time is the weight bytes it streams and the kernel's
per-row cost. hetero's INT8 graphs (per-tensor u8 activations, 7-bit per-channel weights, `export`) run one row
through `MatMulIntegerToFloat`, and their per-tensor activation scale needs the shadow corrections (Eq. 1) on
the CPU for the values beyond it. ONNX Runtime's `MatMulNBits` at accuracy level 4 quantizes each row's
activations to int8 per block of K at run time (one scale per block, MLAS's int8 kernel), so an outlier only
coarsens its own block and no shadow is needed; its weights are quantized per block too. On the default model
(AMD EPYC Zen 4, 1 thread) 8-bit weights in blocks of 128 run a one-row step's 30 layers' graphs in ~0.65×
the INT8 graphs' time (docs/journal.md, "Issue 24 item 3: decode on ONNX Runtime's MatMulNBits"). The kernel's cost
grows with the rows faster than the INT8 GEMM's, but a whole step, with the INT8 graphs' shadow corrections per row,
stays cheaper up to the largest token tree (8 rows): decode steps of up to `NBITS_ROWS` rows run it
(`npu.placement.decode_placement`).

A layer is two graphs with the segments' buffers (`segments.Buffer`): `qkv` (RMSNorm, q|k|v) and `o_ffn` (o, the
residual, RMSNorm, gate|up, the activation, down, the residual), the plan's online Hadamards (`plan.online`) in
front of their sites as in the INT8 graphs, the weights the method's float ones (the rotated copy's for the
default), W·T on online sites. The weights are quantized by ONNX Runtime's own kernel (`quantize_matmul_8bits`
/ `_4bits`, what its `MatMulNBitsQuantizer` calls), in the layout MatMulNBits reads. Graphs are cached and
verified like the segments (`providers.compiled_entry`). A graph is built from the float weights in torch (a cold
build); a warm start only loads the cached graphs and never imports torch. Buffers are float32 numpy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from hetero import buffers
from hetero.errors import ConfigError
from hetero.loader import release_pages, row_blocks
from hetero.npu import segments
from hetero.npu.cache import entry_key, library_versions
from hetero.npu.graph_backend import PREPARE_THREADS
from hetero.npu.program import GraphRun, LayerProgram
from hetero.npu.providers import Graph, OrtCpuProvider, PrepareInfo, compiled_entry
from hetero.npu.segments import Buffer

if TYPE_CHECKING:
    import onnx

    from hetero.loader import Model
    from hetero.weights import LayerWeights, Weights

NBITS_VERSION = 1  # what `layer_graph` builds; in every key: bump when the graphs' math or I/O change
COLUMN_BLOCK = 8 << 20  # float32 values of a weight quantized at a time (32 MB): a block of its output columns
NBITS_ROWS = 8  # decode chunk sizes up to this run MatMulNBits graphs: every tree size (`decode.step.TREE_SIZES`)


@dataclass(frozen=True, slots=True)
class NbitsForm:
    """MatMulNBits' weight form: bits per weight, the block of K sharing a scale, the accuracy level (4: int8
    activations per block, the fast kernel), symmetric (no zero points) or not."""

    bits: int = 8
    block: int = 128
    accuracy_level: int = 4
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or self.block not in (16, 32, 64, 128, 256) or self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ConfigError(f"MatMulNBits form: bits 4 or 8, block 16..256 (a power of 2), accuracy level 0..4; got {self}")

    def describe(self) -> str:
        act = "int8 activations per block" if self.accuracy_level == 4 else f"accuracy level {self.accuracy_level}"
        return (f"ONNX Runtime MatMulNBits, {self.bits}-bit {'symmetric ' if self.symmetric else ''}weights in blocks "
                f"of {self.block} ({act}), no shadow corrections")


DEFAULT_FORM = NbitsForm()
_KINDS = (("qkv", ("qkv",)), ("o_ffn", ("o", "gu", "act", "down")))


def quantize_weight(w_kn: np.ndarray, form: NbitsForm) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(packed [N, K/block, block·bits/8] uint8, scales [N, K/block] float32, zero points or None) of a float weight
    [K, N] as MatMulNBits reads it, quantized by ONNX Runtime's own kernel (round to nearest per block)."""
    from onnxruntime.capi import _pybind_state as C

    k, n = w_kn.shape
    blocks = -(-k // form.block)
    w = np.zeros((blocks * form.block, n), np.float32)
    w[:k] = w_kn
    packed = np.zeros((n, blocks, form.block * form.bits // 8), np.uint8)
    zp = np.zeros((n, -(-blocks * form.bits // 8)), np.uint8)
    scales = np.zeros((n, blocks), np.float32)
    fn = C.quantize_matmul_8bits if form.bits == 8 else C.quantize_matmul_4bits
    fn(packed, w, scales, zp, form.block, n, k, form.symmetric)
    return packed, scales, None if form.symmetric else zp


def layer_graph(kind: str, cfg, lw: "LayerWeights", online: dict[str, int], form: NbitsForm) -> "onnx.ModelProto":
    """One layer's `qkv` or `o_ffn` decode graph (rows symbolic) with MatMulNBits linears (module docstring)."""
    import torch

    from hetero.npu import export
    from hetero.npu.site_ops import online_hadamard

    if kind not in dict(_KINDS):
        raise ConfigError(f"a MatMulNBits decode graph is 'qkv' or 'o_ffn', got {kind!r}")
    g = export.GraphBuilder(f"L_{kind}_nbits{form.bits}b{form.block}")
    f32 = lambda t: t.detach().float().cpu().numpy()  # noqa: E731

    def linear(x: str, site: str, names: tuple[str, ...], biases: tuple[str, ...]) -> str:
        k, n = getattr(lw, names[0]).shape[1], sum(getattr(lw, m).shape[0] for m in names)
        if site in online:  # x·T in front, W·T behind: (x·T)(W·T)ᵀ = x·Wᵀ (`rotate.block_hadamard`)
            x = online_hadamard(g, x, [0], k, online[site])
        step = max(1, COLUMN_BLOCK // k)
        cols = (slice(lo, min(lo + step, n)) for lo in range(0, n, step))
        y = _matmul(g, x, k, n, ((c, site_weight(lw, names, online.get(site, 0), c)) for c in cols), form)
        vec = site_bias(lw, names, biases)
        if vec is not None:
            y = g.op("Add", [y, g.const(vec, "bias")])
        return y

    def norm(x: str, w: torch.Tensor | None) -> str:
        return x if w is None else export.rms_norm(g, x, f32(w), cfg.rms_eps, "cpu")

    post = cfg.post_norms
    if kind == "qkv":
        h = g.input(Buffer.H, ["T", cfg.hidden])
        qkv = linear(norm(h, lw.attn_norm), "attn_in", ("wq", "wk", "wv"), ("bq", "bk", "bv"))
        g.output(qkv, Buffer.QKV, ["T", cfg.q_dim + 2 * cfg.kv_dim])
        return g.model()
    a, h = g.input(Buffer.A, ["T", cfg.q_dim]), g.input(Buffer.H, ["T", cfg.hidden])
    o = norm(linear(a, "o_in", ("wo",), ("bo",)), lw.post_attn_norm if post else None)
    h1 = g.op("Add", [h, o], "h1")
    gu = linear(norm(h1, lw.ffn_norm), "ffn_in", ("w_gate", "w_up"), ("b_gate", "b_up"))
    m = g.op("Mul", [export.activation(g, export.slice_last(g, gu, 0, cfg.ffn), cfg.act),
                     export.slice_last(g, gu, cfg.ffn, 2 * cfg.ffn)], "m")
    d = norm(linear(m, "down_in", ("w_down",), ("b_down",)), lw.post_ffn_norm if post else None)
    g.output(g.op("Add", [h1, d], "h_out"), Buffer.H_OUT, ["T", cfg.hidden])
    return g.model()


def site_weight(lw: "LayerWeights", names: tuple[str, ...], hadamard: int = 0, cols: slice = slice(None)
                ) -> np.ndarray:
    """The float weight [K, N] of one linear site: its matrices (`names`, each [out, K]) side by side, times the
    online transform's block Hadamard of size `hadamard` (0: none) as W·T, so that (x·T)(W·T)ᵀ = x·Wᵀ
    (`rotate.block_hadamard`); only its columns `cols` (a step-1 slice of N): a site packed a block of columns
    at a time is never whole in float (`decode.gemv_step`)."""
    import torch

    from hetero.outliers.rotate import block_hadamard

    mats = [getattr(lw, n).detach() for n in names]
    first, stop, step = cols.indices(sum(m.shape[0] for m in mats))
    if step != 1:
        raise ValueError(f"site_weight takes a slice of step 1, not {step}")
    ws, at = [], 0
    for m in mats:  # each matrix's rows in [first, stop)
        lo, hi = max(first - at, 0), min(stop - at, m.shape[0])
        if hi > lo:
            ws.append(m[lo:hi].double())
        at += m.shape[0]
    if hadamard:
        ws = [block_hadamard(w, hadamard) for w in ws]
    return np.ascontiguousarray(torch.cat(ws).T.float().numpy())


def site_bias(lw: "LayerWeights", names: tuple[str, ...], biases: tuple[str, ...]) -> np.ndarray | None:
    """The site's biases side by side [N] float32 (zeros for a matrix without one), or None when none has one."""
    bs = [getattr(lw, b) for b in biases]
    if all(b is None for b in bs):
        return None
    return np.concatenate([b.detach().float().cpu().numpy() if b is not None
                           else np.zeros(getattr(lw, nm).shape[0], np.float32) for b, nm in zip(bs, names)])


def head_graph(cfg, w: "Weights", form: NbitsForm) -> "onnx.ModelProto":
    """The LM head as one graph: the final RMSNorm, then the MatMulNBits of lm_head ([T, hidden] → logits [T, vocab])."""
    from hetero.npu import export

    g = export.GraphBuilder(f"lm_head_nbits{form.bits}b{form.block}")
    h = g.input(Buffer.H, ["T", cfg.hidden])
    x = export.rms_norm(g, h, w.norm.detach().float().cpu().numpy(), cfg.rms_eps, "cpu")
    blocks = ((rows, block.T) for rows, block in row_blocks(w.lm_head))  # the head [vocab, hidden]: rows are columns
    g.output(_matmul(g, x, cfg.hidden, cfg.vocab, blocks, form), "logits", ["T", cfg.vocab])
    return g.model()


def quantize_columns(k: int, n: int, blocks: Iterable[tuple[slice, np.ndarray]], form: NbitsForm
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`quantize_weight` of a float weight [K, N] given a block of its columns at a time ((cols, W[:, cols]), in
    order): a column's blocks are its own, so this is the whole weight's result, bit for bit, and the weight is never
    whole in float (a 1B head: 1 GB transposed, and the quantizer's padded copy as much again)."""
    nb = -(-k // form.block)
    packed = np.empty((n, nb, form.block * form.bits // 8), np.uint8)
    scales = np.empty((n, nb), np.float32)
    zp = None if form.symmetric else np.empty((n, -(-nb * form.bits // 8)), np.uint8)
    for cols, w_kn in blocks:
        p, sc, z = quantize_weight(w_kn, form)
        packed[cols], scales[cols] = p, sc
        if zp is not None:
            zp[cols] = z
    return packed, scales, zp


def _matmul(g, x: str, k: int, n: int, blocks: Iterable[tuple[slice, np.ndarray]], form: NbitsForm) -> str:
    """x·W as one MatMulNBits node over W [K, N], given a block of columns at a time, quantized by ONNX Runtime
    (`quantize_columns`)."""
    packed, scales, zp = quantize_columns(k, n, blocks, form)
    ins = [x, g.const(packed, "w_nbits"), g.const(scales.reshape(-1), "w_scales")]
    if zp is not None:
        ins.append(g.const(zp.reshape(-1), "w_zp"))
    attrs = {"K": k, "N": n, "bits": form.bits, "block_size": form.block}
    if form.accuracy_level:
        attrs["accuracy_level"] = form.accuracy_level
    return g.op("MatMulNBits", ins, "y", domain="com.microsoft", **attrs)


def head_key(model: "Model", form: NbitsForm, provider: OrtCpuProvider) -> str:
    """The cache key of the LM head's graph (`head_graph`)."""
    return entry_key("hetero-nbits-head", NBITS_VERSION, model.fingerprint, asdict(form), provider.options_key(),
                     library_versions())


def head_session(model: "Model", provider: OrtCpuProvider, form: NbitsForm = DEFAULT_FORM, use_cache: bool = True,
                 graphs_root=None):
    """(session, compiled path or None) of the model's LM head graph (`head_graph`), cached and verified."""
    sess, _, _, path = compiled_entry(head_key(model, form, provider), {"kind": "lm_head", "form": asdict(form)},
                                      provider, lambda: head_graph(model.config, model.weights, form),
                                      f"the LM head (MatMulNBits {form.bits}-bit)", use_cache, graphs_root)
    return sess, path


def graph_key(kind: str, layer: int, model: "Model", online: dict[str, int], form: NbitsForm,
              provider: OrtCpuProvider) -> str:
    """The cache key of a layer's graph: the model (its fingerprint names the float weights, the rotated copy's
    included), the layer, the online transforms, the form, the builder's version, the provider and libraries."""
    return entry_key("hetero-nbits", NBITS_VERSION, kind, layer, model.fingerprint, sorted(online.items()),
                     asdict(form), provider.options_key(), library_versions())


class NbitsBackend:
    """A decode step's layers as MatMulNBits graphs (module docstring): what `decode.bound_step.BoundStep` reads of a
    backend (`cfg`, `model`, `layers`, `program`, `splittable`), rows symbolic, no shadow corrections."""

    name = "nbits"
    any_rows = True
    tensors = "numpy"  # qkv / o_ffn take and return float32 numpy arrays

    def __init__(self, model: "Model", online: dict[str, int], provider: OrtCpuProvider,
                 form: NbitsForm = DEFAULT_FORM, *, layers=None, use_cache: bool = True, graphs_root=None):
        model.config.check_quantizable("MatMulNBits decode graphs")
        self.model, self.cfg, self.online, self.provider, self.form = model, model.config, dict(online), provider, form
        t0 = time.perf_counter()
        todo = list(range(self.cfg.n_layers) if layers is None else layers)
        # as `NpuBackend._prepare_layers`: the first layer alone, the rest on a few threads (a session's creation
        # runs mostly without the GIL)
        made = [self._prepare(layer, use_cache, graphs_root) for layer in todo[:1]]
        with ThreadPoolExecutor(min(PREPARE_THREADS, os.cpu_count() or 1), thread_name_prefix="hetero-nbits") as pool:
            made += pool.map(lambda layer: self._prepare(layer, use_cache, graphs_root), todo[1:])
        self._programs = {program.layer: program for program, _ in made}
        self.report = [info for _, infos in made for info in infos]  # by layer, qkv then o_ffn
        self.prepare_s = time.perf_counter() - t0

    def _prepare(self, layer: int, use_cache: bool, graphs_root) -> tuple[LayerProgram, list[PrepareInfo]]:
        runs, infos, built = [], [], []

        def build(kind: str) -> "onnx.ModelProto":
            built.append(kind)
            return layer_graph(kind, self.cfg, self.model.weights.layers[layer], self.online, self.form)

        for kind, pieces in _KINDS:
            spec = segments.SegmentSpec(layer, kind, pieces, segments.DYNAMIC_ROWS, "cpu")
            key = graph_key(kind, layer, self.model, self.online, self.form, self.provider)
            t0 = time.perf_counter()
            meta = {"layer": layer, "kind": kind, "form": asdict(self.form), "online": self.online}
            sess, cached, size, path = compiled_entry(
                key, meta, self.provider,  # the float weights (torch) only when a graph is built
                lambda kind=kind: build(kind), f"layer {layer} {kind} (MatMulNBits {self.form.bits}-bit)", use_cache,
                graphs_root)
            ins, outs = self._io(kind)
            runs.append(GraphRun(Graph(sess, spec, ins, outs, self.provider.device, path), None))
            infos.append(PrepareInfo(key, cached, time.perf_counter() - t0, size))
        if built:  # the layer's float weights were read: their mapped pages need not stay (gemma-3-1b's: 2.8 GB)
            release_pages(*self.model.weights.layers[layer].tensors())
        return LayerProgram(layer, tuple(runs)), infos

    def _io(self, kind: str) -> tuple[dict[str, int], dict[str, int]]:
        c = self.cfg
        if kind == "qkv":
            return {Buffer.H: c.hidden}, {Buffer.QKV: c.q_dim + 2 * c.kv_dim}
        return {Buffer.A: c.q_dim, Buffer.H: c.hidden}, {Buffer.H_OUT: c.hidden}

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self._programs)

    @property
    def splittable(self) -> bool:
        """Its one-row graphs may run as column halves on two cores (`decode.twocore.halves`)."""
        return True

    def program(self, layer: int) -> LayerProgram:
        program = self._programs.get(layer)
        if program is None:
            raise ConfigError(f"layer {layer} was not prepared (prepared: {sorted(self._programs)})")
        return program

    def shadow_delta(self, layer: int, site: str, x: np.ndarray, per_row: bool = False) -> None:
        """No shadow corrections: MatMulNBits quantizes the activations per block at run time."""
        return None

    # a LayerBackend too (the unbound reference of the bound step's graphs, tests)
    def qkv(self, layer: int, h: np.ndarray, out: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if out is None:
            out = buffers.empty((h.shape[0], self.cfg.q_dim + 2 * self.cfg.kv_dim))
        self.program(layer).runs[0].run({Buffer.H: h}, {Buffer.QKV: out})
        qd, kd = self.cfg.q_dim, self.cfg.kv_dim
        return out[:, :qd], out[:, qd : qd + kd], out[:, qd + kd :]

    def o_ffn(self, layer: int, a: np.ndarray, h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out = buffers.empty((h.shape[0], self.cfg.hidden))
        self.program(layer).runs[1].run({Buffer.A: a, Buffer.H: h}, {Buffer.H_OUT: out})
        return out
