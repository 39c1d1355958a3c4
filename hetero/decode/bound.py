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
import onnxruntime as ort
import torch

from hetero import model as ref
from hetero.decode.attnpool import AttentionPool
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


class BoundStep:
    """`forward(cache, tree, slot)` → the hidden states [C, hidden] of a C-row chunk, no per-run binding."""

    def __init__(self, backend, rope: ref.RopeTable, rows: int, pool: AttentionPool | None = None):
        self.backend, self.cfg, self.rope, self.rows, self.pool = backend, backend.cfg, rope, rows, pool
        cfg = self.cfg
        self.h = (torch.zeros(rows, cfg.hidden), torch.zeros(rows, cfg.hidden))  # layer l reads h[l % 2]
        self.a = torch.zeros(rows, cfg.q_dim)  # attention output, every layer's o input
        self.q = np.zeros((rows, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim), np.float32)
        self.runs: list[list[_Run]] = []
        for layer in range(cfg.n_layers):
            if layer not in backend.layers:
                break
            self.runs.append(self._bind_layer(layer))

    def _bind_layer(self, layer: int) -> list[_Run]:
        """Bind the layer's graphs in order; a graph's inputs are the buffers earlier graphs wrote."""
        env = {"h": self.h[layer % 2], "a": self.a}
        runs = []
        for g in self.backend.layers[layer].graphs:
            ins = {name: env[name] for name in g.inputs}
            outs = {name: self.h[(layer + 1) % 2] if name == "h_out" else torch.zeros(self.rows, width)
                    for name, width in g.outputs.items()}  # fresh buffers: an output never aliases an input
            runs.append(_Run(g.session, g.bind(ins, outs), g.spec.pieces[-1], outs))
            env.update(outs)
        return runs

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
            qkv_run.session.run_with_iobinding(qkv_run.binding)
            qkv = qkv_run.outs["qkv"]
            if "attn_in" in shadow[layer]:
                extra = delta(layer, "attn_in", qkv_run.outs["x"])
                if extra is not None:
                    qkv += extra
            kc, vc = cache.layer(layer)
            if shared:  # both threads (`attnpool`): the same kernel per KV head, the same result
                self.pool.attend(cfg, layer, qkv, kc, vc, layout)
            else:
                decode_rows(cfg, qkv, kc, vc, layout, self.a)
            env: dict[str, torch.Tensor] = {"a": self.a}
            d_extra = None
            for run in rest:
                run.session.run_with_iobinding(run.binding)
                env.update(run.outs)
                if shadow[layer] and run.last != "down":
                    extra = be.cut_correction(layer, run.last, env, per_row=True)
                    if extra is not None:  # down_in's, added to d before the residual
                        d_extra = extra
            last = rest[-1].outs
            if "d" in last:  # a separate down graph: h1 + (d + shadow), as `NpuBackend.o_ffn`
                d = last["d"] if d_extra is None else last["d"].add_(d_extra)
                torch.add(env["h1"], d, out=self.h[(layer + 1) % 2])

