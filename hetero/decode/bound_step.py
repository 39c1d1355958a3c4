"""Decode steps on an INT8 lane with every graph bound once (IOBinding to fixed buffers).

A plain decode step (C = 1) runs ~80 small graphs (per layer qkv, o_ffn and the shadow cuts) with
attention between them; at decode sizes each graph's own work is small, so rebinding inputs and outputs on
every run and the wrappers around it cost a sizeable share of the step (Transformer-Lite §2.4's point about
preallocated buffers, applied to the decode graphs). Here each graph of a chunk size's backend gets its own
IOBinding once, to buffers owned by the `BoundStep` of that size (the hidden state ping-pongs between two),
so a run is one call. The graphs and the shadow corrections are the layer's program (`npu.program.LayerProgram`),
which the prefill interprets too; the attention of all the chunk's rows is one compiled pass over the cache
(`rowattn.decode_rows`), whose rows equal `model.attention` with the row kernel `rowattn.row_attention`: logits
and K/V equal the unbound path's bit for bit (tested), and a tree row equals the plain step of its token, so
greedy speculation emits plain greedy's tokens. Buffers are numpy (no torch on the default path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from hetero import buffers
from hetero.attention import qk_norm_
from hetero.decode.twocore.stages import Stages, split_available
from hetero.decode.twocore.attnpool import AttentionPool, StageTable
from hetero.decode.rowattn import RowLayout, decode_rows, tree_layout
from hetero.decode.tree import TokenTree
from hetero.kv_cache import KVCache
from hetero.npu.program import GraphRun
from hetero.npu.segments import Buffer
from hetero.rope import RopeTable


@dataclass(slots=True)
class _Run:
    """One graph of a layer's program bound to its buffers (`ins` it reads, `outs` it writes)."""

    graph: GraphRun
    binding: ort.IOBinding
    ins: dict[str, np.ndarray]
    outs: dict[str, np.ndarray]
    stages: tuple[int, int] | None = None  # its split form: stages first..last-1 of the step's `_Stages`


class BoundStep:
    """`forward(cache, tree, slot)` → the hidden states [C, hidden] of a C-row chunk, no per-run binding."""

    def __init__(self, backend, rope: RopeTable, rows: int, pool: AttentionPool | None = None):
        self.backend, self.cfg, self.rope, self.rows, self.pool = backend, backend.cfg, rope, rows, pool
        cfg = self.cfg
        self.weights = backend.model.arrays()  # the weights at rest: the embedding rows, QK-norm weights
        self.embed_scale = None if cfg.embed_scale == 1.0 else np.float32(cfg.embed_scale)
        zeros = lambda width: buffers.zeros((rows, width))  # noqa: E731
        self.h = (zeros(cfg.hidden), zeros(cfg.hidden))  # layer l reads h[l % 2]
        self.a = zeros(cfg.q_dim)  # attention output, every layer's o input
        self.q = buffers.zeros((rows, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim))
        self.runs = [self._bind_layer(layer) for layer in backend.layers]
        self.stages: StageTable | None = None  # the split forms, once `split` has built them

    def split(self) -> bool:
        """Build the split forms (`halves`) of a one-row step's graphs, so that a step beside the helper thread runs
        each matmul's column halves on two cores; whether they exist now. Not for QNN graphs (context binaries) nor
        graphs built without the cache (no model file). Building them costs ~1 s (270 sessions), which a step
        repays ~2 ms at a time: `DecodeStep` splits once a decode has run long enough (`SPLIT_AFTER_STEPS`)."""
        if self.stages is not None:
            return True
        if self.rows != 1 or self.pool is None or not split_available(self.backend):
            return False
        import onnx  # only when splitting (a long decode): `hetero run` never imports it

        stages = Stages()
        for runs in self.runs:
            for run in runs:
                if run.graph.source is not None:
                    run.stages = stages.add(onnx.load(str(run.graph.source)), run.ins, run.outs)
        self._stages, self.stages = stages, stages.table()
        return True

    def _bind_layer(self, layer: int) -> list[_Run]:
        """Bind the layer's program in order; a graph's inputs are the buffers earlier graphs wrote."""
        env = {Buffer.H: self.h[layer % 2], Buffer.A: self.a}
        runs = []
        for g in self.backend.program(layer).runs:
            ins = {name: env[name] for name in g.inputs}
            outs = {name: self.h[(layer + 1) % 2] if name == Buffer.H_OUT else buffers.zeros((self.rows, width))
                    for name, width in g.outputs.items()}  # fresh buffers: an output never aliases an input
            runs.append(_Run(g, g.bind(ins, outs), ins, outs))
            env.update(outs)
        return runs

    def _run(self, run: _Run, shared: bool) -> None:
        """One graph: split over both threads when the helper is in this step, else whole on this thread (the
        halves one after the other cost 7.4 instead of 5.4 ms a step: 270 runs instead of 78)."""
        if shared and run.stages is not None:
            self.pool.run_stages(self.stages, *run.stages)
        else:
            run.graph.run_bound(run.binding)

    def forward(self, cache: KVCache, tree: TokenTree, slot: int, layers: int | None = None) -> np.ndarray:
        """The hidden states [C, hidden] after `layers` layers (default all) of the tree's rows (padded to C
        with the root) rooted at position `slot`; their K/V go to cache rows slot.. (cache.length unchanged)."""
        depth = len(self.runs) if layers is None else layers
        layout, shared, bases = start_rows(self, cache, tree, slot, depth)
        self._layers(cache, layout, depth, shared, bases)  # the caller ends the pool's step (after the LM head)
        return self.h[depth % 2]

    def _layers(self, cache: KVCache, layout, depth: int, shared: bool, bases: list[int]) -> None:
        cfg = self.cfg
        for layer in range(depth):
            qkv_run, *rest = self.runs[layer]
            self._run(qkv_run, shared)
            self._correct(layer, qkv_run, qkv_run.outs)  # attn_in's shadow, before attention reads q, k, v
            qkv = qkv_run.outs[Buffer.QKV]
            if cfg.qk_norm:  # between the qkv graph and attention (Qwen3), as `model.attention`
                self._qk_norm(layer, qkv)
            if shared:  # both threads (`attnpool`): the same kernel per KV head, the same result
                self.pool.attend(cfg, layer, qkv, layout, bases[layer])
            else:
                decode_rows(cfg, qkv, *cache.layer(layer), layout, self.a, layer, bases[layer])
            env: dict[str, np.ndarray] = {Buffer.A: self.a}
            d_extra = None
            for run in rest:
                self._run(run, shared)
                env.update(run.outs)
                extra = self._correct(layer, run, env)
                if extra is not None:  # down_in's, added to d before the residual
                    d_extra = extra
            last = rest[-1].outs
            if Buffer.D in last:  # a separate down graph: h1 + (d + shadow), as `NpuBackend.o_ffn`
                d = last[Buffer.D]
                if d_extra is not None:
                    d += d_extra
                self.backend.program(layer).finish(env[Buffer.H1], d, self.h[(layer + 1) % 2])

    def _qk_norm(self, layer: int, qkv: np.ndarray) -> None:
        """QK-norm of the rows' q and k heads in place (`attention.qk_norm_`, the reference's ops), its weights read
        at rest (`Model.arrays`)."""
        qk_norm_(self.cfg, qkv, self.weights[f"layers.{layer}.q_norm"], self.weights[f"layers.{layer}.k_norm"])

    def _correct(self, layer: int, run: _Run, env: dict[str, np.ndarray]) -> np.ndarray | None:
        """The shadow correction after a run (each row's own, after one compiled range check of all rows)."""
        shadow = run.graph.shadow
        if shadow is None:
            return None
        return shadow.apply(env, self.backend.shadow_delta(layer, shadow.site, env[shadow.source], per_row=True))


def start_rows(step, cache: KVCache, tree: TokenTree, slot: int, depth: int) -> tuple[RowLayout, bool, list[int]]:
    """The start of a step over fixed buffers (`BoundStep`, `gemv_step.GemvStep`: cfg, rows, weights, embed_scale, rope,
    h, a, q, pool): the rows' embeddings into step.h[0] (the tree padded to C rows with its root; times Gemma 3's
    scale as `model.embed`, float32 products), their layout, the helper woken for the step (whether it is in it), and
    each layer's cache base (windowed layers: their window, `KVCache.place`)."""
    cfg, c, n = step.cfg, step.rows, len(tree)
    step.weights["tok_emb"].take(tree.tokens + [tree.tokens[0]] * (c - n), axis=0, out=step.h[0])  # (`FileRows`)
    if step.embed_scale is not None:
        np.multiply(step.h[0], step.embed_scale, out=step.h[0])
    layout = tree_layout(tree.depth, tree.parents, slot, step.rope)
    step.a[n:] = 0  # padding rows: their attention stays zero (their K/V never reach the cache)
    q = step.q[:n]
    shared = step.pool is not None and step.pool.begin(
        cache.k, cache.v, q, layout.extra, layout.n_extra, cfg.scale, step.a[:n].reshape(q.shape))
    bases = [cache.place(layer, slot, n) for layer in range(depth)]
    return layout, shared, bases
