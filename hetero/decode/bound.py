"""The one-token decode step on an INT8 lane with every graph bound once (IOBinding to fixed buffers).

A plain decode step (C = 1) runs ~80 small graphs (per layer qkv, o_ffn and the shadow cuts) with
attention between them; at C = 1 each graph's own work is small, so rebinding inputs and outputs on every
run and the wrappers around it cost a sizeable share of the step (Transformer-Lite §2.4's point about
preallocated buffers, applied to the decode graphs). Here each graph of the C = 1 backend gets its own
IOBinding once, to buffers owned by this object (the hidden state ping-pongs between two), so a run is one
call. The graphs, the shadow corrections (`NpuBackend.cut_correction`) and the attention
(`model.attention` for one row, `model.one_row_attention`) are the ones `DecodeStep.forward` runs: the logits equal its logits for a
one-token tree bit for bit (tested), so greedy speculation (tree rows through `forward`) still emits plain
greedy's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnxruntime as ort
import torch

from hetero import model as ref
from hetero.kv_cache import KVCache


@dataclass(slots=True)
class _Run:
    """One graph bound to its buffers; `outs` names the buffers it writes (the env after it runs)."""

    session: ort.InferenceSession
    binding: ort.IOBinding
    last: str  # its last piece ("qkv", "o", "gu", "act", "down"): which shadow site follows it
    outs: dict[str, torch.Tensor]


class BoundStep:
    """`forward(cache, token, slot)` → the hidden state after the layers: one token, no per-run binding."""

    def __init__(self, backend, rope: ref.RopeTable):
        self.backend, self.cfg, self.rope = backend, backend.cfg, rope
        cfg = self.cfg
        self.h = (torch.zeros(1, cfg.hidden), torch.zeros(1, cfg.hidden))  # layer l reads h[l % 2], writes the other
        self.a = torch.zeros(1, cfg.q_dim)  # attention output, every layer's o input
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
            outs = {name: self.h[(layer + 1) % 2] if name == "h_out" else torch.zeros(1, width)
                    for name, width in g.outputs.items()}  # fresh buffers: an output never aliases an input
            runs.append(_Run(g.session, g.bind(ins, outs), g.spec.pieces[-1], outs))
            env.update(outs)
        return runs

    def forward(self, cache: KVCache, token: int, slot: int, layers: int | None = None) -> torch.Tensor:
        """The hidden state [1, hidden] after `layers` layers (default all) of `token` at position `slot`;
        its K/V go to cache row `slot` of every layer (cache.length is not changed)."""
        cfg, be = self.cfg, self.backend
        n = len(self.runs) if layers is None else layers
        qd, kd = cfg.q_dim, cfg.kv_dim
        heads, hd, end = cfg.n_heads + cfg.n_kv_heads, cfg.head_dim, slot + 1
        self.h[0].copy_(ref.embed(be.model.weights, torch.tensor([token])))
        shadow = [be.layers[layer].shadow_sites for layer in range(n)]
        for layer in range(n):
            qkv_run, *rest = self.runs[layer]
            qkv_run.session.run_with_iobinding(qkv_run.binding)
            qkv = qkv_run.outs["qkv"]
            if "attn_in" in shadow[layer]:
                extra = be.reference.shadow_delta(layer, "attn_in", qkv_run.outs["x"])
                if extra is not None:
                    qkv += extra
            # `model.attention` for one row: RoPE on q and k at once (elementwise, the same values), K/V to
            # row `slot`, then the row's attention over [0, slot] (`model.one_row_attention`)
            qk = self.rope.apply(qkv[:, : qd + kd].view(heads, hd)[:, None], slot)  # [H + n_kv, 1, D]
            kc, vc = cache.layer(layer)
            kc[:, slot] = qk[cfg.n_heads :, 0]
            vc[:, slot] = qkv[:, qd + kd :].view(cfg.n_kv_heads, hd)
            self.a.view(cfg.n_heads, hd).copy_(ref.one_row_attention(cfg, qk[: cfg.n_heads], kc[:, :end], vc[:, :end])[:, 0])
            env: dict[str, torch.Tensor] = {"a": self.a}
            d_extra = None
            for run in rest:
                run.session.run_with_iobinding(run.binding)
                env.update(run.outs)
                if shadow[layer] and run.last != "down":
                    extra = be.cut_correction(layer, run.last, env)
                    if extra is not None:  # down_in's, added to d before the residual
                        d_extra = extra
            last = rest[-1].outs
            if "d" in last:  # a separate down graph: h1 + (d + shadow), as `NpuBackend.o_ffn`
                d = last["d"] if d_extra is None else last["d"].add_(d_extra)
                torch.add(env["h1"], d, out=self.h[(layer + 1) % 2])
        return self.h[n % 2]
