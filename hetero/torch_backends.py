"""Layer backends in torch: the layer of `hetero.model` with a given site linear.

A backend runs the static subgraphs (`qkv`, `o_ffn`) of a layer (`model.LayerBackend`); attention is
dynamic and always runs in float on the CPU/GPU (mllm-NPU §3.2). `FloatBackend` is the reference every
other backend is checked against.
"""

from __future__ import annotations

import torch

from hetero import model as ref
from hetero.config import ModelConfig
from hetero.model import FloatLinear, LayerBackend, SiteLinear, Weights

__all__ = ["FloatBackend", "LayerBackend", "TorchBackend"]


class TorchBackend:
    """`hetero.model`'s layer in torch, every linear through `linear(layer, site, x)`."""

    name = "torch"
    any_rows = True  # torch runs chunks of any row count: no padding to C

    def __init__(self, cfg: ModelConfig, weights: Weights, linear: SiteLinear):
        self.cfg, self.weights, self.linear = cfg, weights, linear

    def qkv(self, layer: int, h: torch.Tensor, out: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = ref.qkv(self.cfg, self.weights.layers[layer], h, self.linear, layer)
        if out is None:
            return q, k, v
        torch.cat((q, k, v), dim=1, out=out)  # packed, as the NPU lane's graphs write it
        qd, kd = self.cfg.q_dim, self.cfg.kv_dim
        return out[:, :qd], out[:, qd : qd + kd], out[:, qd + kd :]

    def o_ffn(self, layer: int, a: torch.Tensor, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return ref.o_ffn(self.cfg, self.weights.layers[layer], a, h, self.linear, layer)


class FloatBackend(TorchBackend):
    """The float reference, subgraph by subgraph."""

    name = "float"

    def __init__(self, cfg: ModelConfig, weights: Weights):
        super().__init__(cfg, weights, FloatLinear(weights))
