"""A layer's static work as one typed value: the graphs it runs in order, the buffers they pass, and where the
CPU adds a shadow correction (mllm-NPU §3.2-3.3).

`NpuBackend.program(layer)` builds it once per layer; the prefill (`NpuBackend.qkv` / `o_ffn`) and the decode
step (`decode.bound_step.BoundStep`) both interpret it, so neither reads the other's fields and a change of the
graphs' cut (`segments.layer_segments`) reaches both. Buffer names: `segments.Buffer`. Buffers are float32 numpy
arrays (a warm INT8 start never imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

from hetero.npu.providers import Graph

if TYPE_CHECKING:
    import onnxruntime as ort
from hetero.npu.segments import Buffer

# the last piece of a graph → the site whose shadow follows it, the buffer holding that site's float input, and the
# buffer the correction is added to (D: down_in's, added to d before the residual, as the reference's order)
_AFTER = {"qkv": ("attn_in", Buffer.X, Buffer.QKV), "o": ("o_in", Buffer.A, Buffer.O),
          "gu": ("ffn_in", Buffer.X, Buffer.GU), "act": ("down_in", Buffer.M, Buffer.D)}


@dataclass(frozen=True, slots=True)
class Shadow:
    """A shadow correction (Eq. 1) after a graph run: the site's float outliers times its weight rows, on the CPU."""

    site: str  # "attn_in" | "o_in" | "ffn_in" | "down_in"
    source: Buffer  # the site's float input (a graph output, or `A`, which the CPU wrote)
    target: Buffer  # where the correction is added: in place, or for `D` after the down graph, before h1 + d

    def apply(self, env: dict[str, np.ndarray], delta: np.ndarray | None) -> np.ndarray | None:
        """Add `delta` to its target in `env` now, or return it when it waits for the down graph (`D`)."""
        if delta is None or self.target == Buffer.D:
            return delta
        env[self.target] += delta
        return None


@dataclass(frozen=True, slots=True)
class GraphRun:
    """One graph of a layer in execution order, and the shadow correction that follows it (None: none)."""

    graph: Graph
    shadow: Shadow | None

    @property
    def inputs(self) -> dict[str, int]:
        """Buffer → width of what it reads."""
        return self.graph.inputs

    @property
    def outputs(self) -> dict[str, int]:
        """Buffer → width of what it writes."""
        return self.graph.outputs

    @property
    def source(self) -> Path | None:
        """Its compiled ONNX file in the graph cache (a decode step cuts its split form from it), None when it was
        built without the cache."""
        return self.graph.path

    def run(self, inputs: dict[str, np.ndarray], out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Run on these buffers (`providers.Graph.run`)."""
        return self.graph.run(inputs, out)

    def bind(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> "ort.IOBinding":
        """A binding of its own to fixed buffers (`providers.Graph.bind`); run it with `run_bound`."""
        return self.graph.bind(inputs, outputs)

    def run_bound(self, binding: "ort.IOBinding") -> None:
        self.graph.session.run_with_iobinding(binding)


@dataclass(frozen=True, slots=True)
class LayerProgram:
    """A layer's graphs in order: runs[0] is qkv (h → qkv), the rest o_ffn's segments (a, h → h_out, or → h1 and d
    when the down graph stands alone, whose caller adds h1 + d)."""

    layer: int
    runs: tuple[GraphRun, ...]
    post_ffn_norm: np.ndarray | None = None  # Gemma 3's RMSNorm of d before the residual add (`finish`)
    eps: float = 0.0

    @property
    def shadowed(self) -> bool:
        return any(r.shadow is not None for r in self.runs)

    def finish(self, h1: np.ndarray, d: np.ndarray, out: np.ndarray) -> np.ndarray:
        """A stand-alone down graph's residual: out = h1 + d (d already holds down_in's shadow), with Gemma 3's
        post-norm of d first: the reference's order and float math (`model.o_ffn`, in torch)."""
        if self.post_ffn_norm is not None:
            import torch

            from hetero.model import rms_norm

            with torch.inference_mode():
                d = rms_norm(torch.from_numpy(d), torch.from_numpy(self.post_ffn_norm), self.eps).numpy()
        return np.add(h1, d, out=out)


def layer_program(layer: int, graphs: list[Graph], shadow_sites: frozenset[str],
                  post_ffn_norm: np.ndarray | None = None, eps: float = 0.0) -> LayerProgram:
    """The program of a layer's prepared graphs (`segments.layer_segments` order) given its shadowed sites (and
    Gemma 3's post-norm of d, which `LayerProgram.finish` applies after a stand-alone down graph)."""
    runs = []
    for g in graphs:
        after = _AFTER.get(g.spec.pieces[-1])
        shadow = Shadow(*after) if after is not None and after[0] in shadow_sites else None
        runs.append(GraphRun(g, shadow))
    return LayerProgram(layer, tuple(runs), post_ffn_norm, eps)
