"""Decode steps on an INT8 lane with every graph bound once (IOBinding to fixed buffers).

A plain decode step (C = 1) runs ~80 small graphs (per layer qkv, o_ffn and the shadow cuts) with
attention between them; at decode sizes each graph's own work is small, so rebinding inputs and outputs on
every run and the wrappers around it cost a sizeable share of the step (Transformer-Lite §2.4's point about
preallocated buffers, applied to the decode graphs). Here each graph of a chunk size's backend gets its own
IOBinding once, to buffers owned by the `BoundStep` of that size (the hidden state ping-pongs between two),
so a run is one call. The graphs and the shadow corrections (`NpuBackend.cut_correction`) are the ones the
unbound path runs; the attention of all the chunk's rows is one compiled pass over the cache
(`rowattn.decode_rows`), whose rows equal `model.attention` with the row kernel `rowattn.row_attention`: logits
and K/V equal the unbound path's bit for bit (tested), and a tree row equals the plain step of its token, so
greedy speculation emits plain greedy's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import torch

from hetero import model as ref
from hetero.attention import qk_norm_
from hetero.decode import halves, ortc
from hetero.decode.attnpool import AttentionPool, StageTable
from hetero.decode.rowattn import decode_rows, tree_layout
from hetero.decode.tree import TokenTree
from hetero.kv_cache import KVCache


@dataclass(slots=True)
class _Run:
    """One graph bound to its buffers; `outs` names the buffers it writes (the env after it runs)."""

    session: ort.InferenceSession
    binding: ort.IOBinding
    last: str  # its last piece ("qkv", "o", "gu", "act", "down"): which shadow site follows it
    outs: dict[str, torch.Tensor]
    stages: tuple[int, int] | None = None  # its split form: stages first..last-1 of the step's `_Stages`


class _Stages:
    """The split forms (`halves`) of a one-row step's graphs as C API sessions bound to the step's buffers: stage i
    is session ms[i] / binding mb[i] (its first column half, or a tail) and hs[i] / hb[i] (its second half)."""

    def __init__(self) -> None:
        self.ortc = ortc.OrtC.get()
        self.ms: list[int] = []
        self.mb: list[int] = []
        self.hs: list[int] = []
        self.hb: list[int] = []
        self._keep: list[object] = []  # sessions, bindings and intermediate buffers

    def add(self, model: onnx.ModelProto, ins: dict[str, torch.Tensor], outs: dict[str, torch.Tensor]
            ) -> tuple[int, int] | None:
        """The stages of one graph reading `ins` and writing `outs` ([1, width] buffers); None if it has no
        splittable matmul."""
        split = halves.split_graph(model)
        if split is None:
            return None
        env = dict(ins) | dict(outs)
        for name, width in split.widths.items():
            if name not in env:
                env[name] = torch.zeros(1, width)
        self._keep.append(env)
        first = len(self.ms)
        for stage in split.stages:
            bound = []
            for h, half in enumerate(stage.halves):
                sess = self.ortc.session(half)
                names_in = [i.name for i in half.graph.input]
                names_out = [o.name for o in half.graph.output]
                b = sess.bind({n: (env[n].data_ptr(), tuple(env[n].shape)) for n in names_in},
                              {n: self._column_half(env[n], stage.split, n, h) for n in names_out})
                self._keep += [sess, b]
                bound.append((sess.ptr, b.ptr))
            (ms, mb), (hs, hb) = bound[0], bound[1] if len(bound) == 2 else (0, 0)
            self.ms.append(ms), self.mb.append(mb), self.hs.append(hs), self.hb.append(hb)
        return first, len(self.ms)

    @staticmethod
    def _column_half(t: torch.Tensor, split: dict[str, int], name: str, half: int) -> tuple[int, tuple[int, ...]]:
        """(address, shape) of what a half writes of buffer t: its columns of a split matmul's output, else all."""
        if name not in split:
            return t.data_ptr(), tuple(t.shape)
        lo, hi = halves.columns(split[name], half)
        return t.data_ptr() + 4 * lo, (1, hi - lo)

    def table(self) -> StageTable:
        as_array = lambda xs: np.asarray(xs, np.int64)  # noqa: E731
        return StageTable(self.ortc.run_fn, as_array(self.ms), as_array(self.mb), as_array(self.hs),
                          as_array(self.hb), self.ortc.check)


class BoundStep:
    """`forward(cache, tree, slot)` → the hidden states [C, hidden] of a C-row chunk, no per-run binding."""

    def __init__(self, backend, rope: ref.RopeTable, rows: int, pool: AttentionPool | None = None):
        self.backend, self.cfg, self.rope, self.rows, self.pool = backend, backend.cfg, rope, rows, pool
        cfg = self.cfg
        self.h = (torch.zeros(rows, cfg.hidden), torch.zeros(rows, cfg.hidden))  # layer l reads h[l % 2]
        self.a = torch.zeros(rows, cfg.q_dim)  # attention output, every layer's o input
        self.q = np.zeros((rows, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim), np.float32)
        # One-row steps beside a helper thread run split graphs (`halves`): each matmul's column halves on two
        # cores. Not for QNN graphs (context binaries) nor graphs built without the cache (no model file).
        self._stages = _Stages() if rows == 1 and pool is not None and split_available(backend) else None
        self.runs: list[list[_Run]] = []
        for layer in range(cfg.n_layers):
            if layer not in backend.layers:
                break
            self.runs.append(self._bind_layer(layer))
        self.stages = None if self._stages is None else self._stages.table()

    def _bind_layer(self, layer: int) -> list[_Run]:
        """Bind the layer's graphs in order; a graph's inputs are the buffers earlier graphs wrote."""
        env = {"h": self.h[layer % 2], "a": self.a}
        runs = []
        for g in self.backend.layers[layer].graphs:
            ins = {name: env[name] for name in g.inputs}
            outs = {name: self.h[(layer + 1) % 2] if name == "h_out" else torch.zeros(self.rows, width)
                    for name, width in g.outputs.items()}  # fresh buffers: an output never aliases an input
            run = _Run(g.session, g.bind(ins, outs), g.spec.pieces[-1], outs)
            if self._stages is not None and g.path is not None:
                run.stages = self._stages.add(onnx.load(str(g.path)), ins, outs)
            runs.append(run)
            env.update(outs)
        return runs

    def _run(self, run: _Run, shared: bool) -> None:
        """One graph: split over both threads when the helper is in this step, else whole on this thread (the
        halves one after the other cost 7.4 instead of 5.4 ms a step: 270 runs instead of 78)."""
        if shared and run.stages is not None:
            self.pool.run_stages(self.stages, *run.stages)
        else:
            run.session.run_with_iobinding(run.binding)

    def forward(self, cache: KVCache, tree: TokenTree, slot: int, layers: int | None = None) -> torch.Tensor:
        """The hidden states [C, hidden] after `layers` layers (default all) of the tree's rows (padded to C
        with the root) rooted at position `slot`; their K/V go to cache rows slot.. (cache.length unchanged)."""
        cfg, be, c, n = self.cfg, self.backend, self.rows, len(tree)
        depth = len(self.runs) if layers is None else layers
        self.h[0].copy_(ref.embed(be.model.weights, torch.tensor(tree.tokens + [tree.tokens[0]] * (c - n))))
        layout = tree_layout(tree.depth, tree.parents, slot, self.rope)
        self.a[n:] = 0  # padding rows: their attention stays zero (their K/V never reach the cache)
        q = self.q[:n]
        shared = self.pool is not None and self.pool.begin(
            cache.k.numpy(), cache.v.numpy(), q, layout.extra, layout.n_extra, cfg.head_dim**-0.5,
            self.a.numpy()[:n].reshape(q.shape))
        self._layers(cache, layout, depth, shared)  # the caller ends the pool's step (after the LM head)
        return self.h[depth % 2]

    def _layers(self, cache: KVCache, layout, depth: int, shared: bool) -> None:
        cfg, be = self.cfg, self.backend
        shadow = [be.layers[layer].shadow_sites for layer in range(depth)]
        delta = be.reference.shadow_delta_rows  # each row's own, after one compiled range check of all rows
        for layer in range(depth):
            qkv_run, *rest = self.runs[layer]
            self._run(qkv_run, shared)
            qkv = qkv_run.outs["qkv"]
            if "attn_in" in shadow[layer]:
                extra = delta(layer, "attn_in", qkv_run.outs["x"])
                if extra is not None:
                    qkv += extra
            if cfg.qk_norm:  # between the qkv graph and attention (Qwen3), as `model.attention`
                lw = be.model.weights.layers[layer]
                qk_norm_(cfg, qkv, lw.q_norm, lw.k_norm)
            if shared:  # both threads (`attnpool`): the same kernel per KV head, the same result
                self.pool.attend(cfg, layer, qkv, layout)
            else:
                decode_rows(cfg, qkv, *cache.layer(layer), layout, self.a)
            env: dict[str, torch.Tensor] = {"a": self.a}
            d_extra = None
            for run in rest:
                self._run(run, shared)
                env.update(run.outs)
                if shadow[layer] and run.last != "down":
                    extra = be.cut_correction(layer, run.last, env, per_row=True)
                    if extra is not None:  # down_in's, added to d before the residual
                        d_extra = extra
            last = rest[-1].outs
            if "d" in last:  # a separate down graph: h1 + (d + shadow), as `NpuBackend.o_ffn`
                d = last["d"] if d_extra is None else last["d"].add_(d_extra)
                torch.add(env["h1"], d, out=self.h[(layer + 1) % 2])


def split_available(backend) -> bool:
    """Whether a backend's one-row graphs can run split (`halves`): ONNX Runtime CPU graphs from the graph cache,
    and the wheel's C library loads."""
    from hetero.npu.providers import OrtCpuProvider

    return isinstance(getattr(backend, "provider", None), OrtCpuProvider) and ortc.run_fn() != 0
