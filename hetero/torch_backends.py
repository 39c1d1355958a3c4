"""Layer backends in torch: the layer of `hetero.model` with a given site linear.

A backend runs the static subgraphs (`qkv`, `o_ffn`) of a layer (`model.LayerBackend`): the generic layer's nodes
(`nodes.LayerNodes`), whose attention is dynamic and runs in float on the CPU (the runtime's, mllm-NPU §3.2).
`FloatBackend` is the reference every other backend is checked against. A torch backend takes torch tensors
(`model.layer_stack`, autograd included) or the runtime's numpy buffers, which it sees through `torch.from_numpy`
views (no copy) and answers in numpy.
"""

from __future__ import annotations

import numpy as np
import torch

from hetero import model as ref
from hetero import nodes
from hetero.config import ModelConfig
from hetero.model import FloatLinear, LayerBackend, SiteLinear
from hetero.weights import Weights

__all__ = ["FloatBackend", "LayerBackend", "TorchBackend"]


class TorchBackend:
    """`hetero.model`'s layer in torch, every linear through `linear(layer, site, x)`."""

    name = "torch"
    tensors = "torch"  # torch tensors in and out; numpy buffers (the runtime's) through views
    any_rows = True  # torch runs chunks of any row count: no padding to C
    node_kinds = nodes.KINDS  # the generic layer: qkv and o_ffn here, the runtime's attention between
    default_placement = nodes.DEFAULT_PLACEMENT

    def __init__(self, cfg: ModelConfig, weights: Weights, linear: SiteLinear):
        self.cfg, self.weights, self.linear = cfg, weights, linear

    def bind(self, job: nodes.Job) -> nodes.LayerNodes:
        """Its nodes bound to a prefill (`LayerBackend.bind`): the generic layer's, nothing kept per prompt."""
        return nodes.LayerNodes(self, job)

    def qkv(self, layer: int, h: torch.Tensor | np.ndarray, out: torch.Tensor | np.ndarray | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[np.ndarray, np.ndarray, np.ndarray]:
        if isinstance(h, np.ndarray):  # the runtime's buffers
            with torch.inference_mode():
                got = self.qkv(layer, torch.from_numpy(h), None if out is None else torch.from_numpy(out))
            return tuple(t.numpy() for t in got)  # type: ignore[return-value]
        q, k, v = ref.qkv(self.cfg, self.weights.layers[layer], h, self.linear, layer)
        if out is None:
            return q, k, v
        torch.cat((q, k, v), dim=1, out=out)  # packed, as the NPU lane's graphs write it
        qd, kd = self.cfg.q_dim, self.cfg.kv_dim
        return out[:, :qd], out[:, qd : qd + kd], out[:, qd + kd :]

    def o_ffn(self, layer: int, a: torch.Tensor | np.ndarray, h: torch.Tensor | np.ndarray,
              out: torch.Tensor | np.ndarray | None = None) -> torch.Tensor | np.ndarray:
        if isinstance(h, np.ndarray):  # the runtime's buffers
            with torch.inference_mode():
                return self.o_ffn(layer, torch.from_numpy(a), torch.from_numpy(h)).numpy()
        return ref.o_ffn(self.cfg, self.weights.layers[layer], a, h, self.linear, layer)


class FloatBackend(TorchBackend):
    """The float reference, subgraph by subgraph."""

    name = "float"
    cut_invariant = True  # its prefill's K/V and logits do not depend on where a prompt is cut (`serve.store`)

    def __init__(self, cfg: ModelConfig, weights: Weights):
        super().__init__(cfg, weights, FloatLinear(weights))
