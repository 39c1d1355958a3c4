"""NPU memory budget (mllm-NPU §4, optimisation 2): which static graphs live on the NPU, which on the CPU.

Mobile NPUs address a limited memory region (≈4 GB on Hexagon), possibly less than the model. Given a
budget in bytes for NPU-resident weights, place the most compute-dense graphs first: every layer's FFN
part (`o_ffn`: 3·ffn·hidden + hidden·q_dim INT8 bytes), then the attention projections (`qkv`); what
does not fit runs as the same INT8 graph on the CPU (ONNX Runtime CPU EP). Each decision is logged with its reason
(ExecuTorch partitioner style) and kept in `Placement.decisions`. Decode steps run on the CPU
(`decode_placement`).
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass

from hetero.torch_backends import LayerBackend
from hetero.errors import ConfigError
from hetero.runtime import DecodePlacement

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Decision:
    layer: int
    kind: str  # "qkv" | "o_ffn" (all segments of o_ffn go together)
    device: str  # "npu" | "cpu"
    size_bytes: int
    reason: str


@dataclass(frozen=True, slots=True)
class Placement:
    budget_bytes: int
    decisions: tuple[Decision, ...]

    def device_of(self, layer: int, kind: str) -> str:
        kind = "qkv" if kind == "qkv" else "o_ffn"
        for d in self.decisions:
            if d.layer == layer and d.kind == kind:
                return d.device
        return "cpu"

    @property
    def npu_bytes(self) -> int:
        return sum(d.size_bytes for d in self.decisions if d.device == "npu")

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "npu_bytes": self.npu_bytes,
                "decisions": [{"layer": d.layer, "kind": d.kind, "device": d.device, "size_bytes": d.size_bytes,
                               "reason": d.reason} for d in self.decisions]}


def graph_weight_bytes(cfg, kind: str) -> int:
    """INT8 weight bytes of one layer's `qkv` or `o_ffn` graph (+ float norm weights)."""
    if kind == "qkv":
        return (cfg.q_dim + 2 * cfg.kv_dim) * cfg.hidden + 4 * cfg.hidden
    return cfg.hidden * cfg.q_dim + 3 * cfg.ffn * cfg.hidden + 4 * cfg.hidden


def place(cfg, budget_bytes: int | None) -> Placement:
    """FFN graphs first (layer order), then QKV; a graph goes to the NPU while it fits in the budget.

    budget_bytes None: unlimited (everything on the NPU).
    """
    if budget_bytes is not None and budget_bytes < 0:
        raise ConfigError(f"NPU memory budget must be >= 0 bytes, got {budget_bytes}")
    left = float("inf") if budget_bytes is None else budget_bytes
    decisions = []
    for kind, why in (("o_ffn", "FFN first: most MACs per weight byte"), ("qkv", "then QKV")):
        size = graph_weight_bytes(cfg, kind)
        for layer in range(cfg.n_layers):
            if size <= left:
                left -= size
                d = Decision(layer, kind, "npu", size, f"{why}; fits ({size} B, {left:.0f} B left)")
            else:
                d = Decision(layer, kind, "cpu", size, f"{why}; NPU budget exhausted ({size} B > {left:.0f} B left): INT8 on CPU")
            log.info("placement | layer %d %s -> %s | %s", d.layer, d.kind, d.device, d.reason)
            decisions.append(d)
    return Placement(-1 if budget_bytes is None else budget_bytes, tuple(decisions))


def decode_placement(backend: LayerBackend) -> DecodePlacement:
    """Where the decode steps of a runtime over `backend` (its prefill's layer ops) run: on the CPU, as in
    mllm-NPU (`DecodePlacement`). A prefill lane on an NPU provider (QNN HTP; on x86-64 its simulator) hands
    decode to the INT8 graphs of the same plan on the ONNX Runtime CPU EP (`NpuBackend.at_chunk`); the CPU EP
    stand-in decodes on its own graphs; float layers in torch."""
    from hetero.npu.isa import cpu_form_for

    provider = getattr(backend, "provider", None)
    plan = getattr(backend, "plan", None)
    if provider is None or plan is None:
        name = getattr(backend, "name", "torch")
        return DecodePlacement("cpu", "torch", f"the prefill's {name} layers in torch, on the CPU already")
    if provider.device == "cpu":
        return DecodePlacement("cpu", provider.name, f"the NPU lane is this CPU EP, so its own INT8 graphs at "
                                                     f"decode sizes (weight form {plan.weight_form})")
    where = " (the HTP simulator)" if provider.name.startswith("qnn") and platform.machine() == "x86_64" else ""
    return DecodePlacement("cpu", "ort-cpu", f"the prefill's NPU lane is {provider.name}{where} and a decode step is "
                           f"memory-bound, so the same plan's INT8 graphs on the CPU EP, its {plan.weight_form} "
                           f"weights in this CPU's exact form {cpu_form_for(plan.weight_form)}")
