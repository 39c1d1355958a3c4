"""What executes the static subgraphs (`qkv`, `o_ffn`) of a layer: the float reference or an INT8 lane.

Attention is dynamic (it depends on the chunk's position) and always runs in float on the CPU/GPU
(mllm-NPU §3.2); a backend only replaces the static subgraphs, one for one, and is checked against
`FloatBackend`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hetero import model as ref
from hetero.config import ModelConfig
from hetero.model import Weights


class LayerBackend(Protocol):
    name: str

    def qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: [C, hidden] → q [C, n_heads*D], k, v [C, n_kv*D] (float)."""
        ...

    def o_ffn(self, layer: int, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """a: attention output [C, n_heads*D], h: residual [C, hidden] → next h [C, hidden]."""
        ...


class FloatBackend:
    """The float reference (`hetero.model`), subgraph by subgraph."""

    name = "float"

    def __init__(self, cfg: ModelConfig, weights: Weights):
        self.cfg, self.weights = cfg, weights

    def qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return ref.qkv(self.cfg, self.weights.layers[layer], h)

    def o_ffn(self, layer: int, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return ref.o_ffn(self.cfg, self.weights.layers[layer], a, h)
