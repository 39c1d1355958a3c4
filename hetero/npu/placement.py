"""Placement (mllm-NPU §4): how a prefill's work is cut into graphs and lanes on this host, and under an NPU
memory budget which static graphs live on the NPU.

The layout (`prefill_layout`): mllm-NPU runs the static subgraphs on the NPU and attention on the CPU, two
lanes out of order (§3.4), which pays where the lanes are two pieces of hardware. Where the "NPU" is the CPU
itself (the ONNX Runtime CPU EP), the lanes split the same cores, each graph gets half of them, and a chunk is
a chain of ~90 hand-offs between them; there each layer runs as one graph (its attention and shadow corrections
inside, `segments.layer_graph`), and with two cores or more the chunks alternate between two lanes of half the
cores each, as a wavefront over chunks and layers (`sched.wavefront`). Which one wins is measured per host
(`hetero npu layout` → `record_layout`); without a record, the rule above decides, and says so.

Mobile NPUs address a limited memory region (≈4 GB on Hexagon), possibly less than the model. Given a
budget in bytes for NPU-resident weights, place the most compute-dense graphs first: every layer's FFN
part (`o_ffn`: 3·ffn·hidden + hidden·q_dim INT8 bytes), then the attention projections (`qkv`); what
does not fit runs as the same INT8 graph on the CPU (ONNX Runtime CPU EP). Each decision is logged with its reason
(ExecuTorch partitioner style) and kept in `Placement.decisions`. Decode steps run on the CPU
(`decode_placement`).
"""

from __future__ import annotations

import json
import logging
import platform
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hetero.errors import ConfigError
from hetero.native import gguf_forms
from hetero.paths import atomic_path, user_profiles_dir
from hetero.hostplan import DecodePlacement, PrefillLayout

if TYPE_CHECKING:
    from hetero.torch_backends import LayerBackend

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


def decode_placement(backend: LayerBackend, decode_form: str | None = None) -> DecodePlacement:
    """Where the decode steps of a runtime over `backend` (its prefill's layer ops) run (`decode_placement_of`)."""
    plan = getattr(backend, "plan", None)
    return decode_placement_of(backend.cfg if plan is not None else None, getattr(backend, "provider", None),
                               getattr(plan, "weight_form", None), getattr(backend, "name", "torch"),
                               getattr(backend, "model", None), decode_form)


DECODE_FORMS = ("auto", *gguf_forms.MADE)  # `hetero run --decode-form`


def decode_placement_of(cfg, provider, weight_form: str | None, name: str = "torch", model=None,
                        decode_form: str | None = None) -> DecodePlacement:
    """Where the decode steps of a runtime run: on the CPU, as in mllm-NPU (`DecodePlacement`). A prefill lane on an
    NPU `provider` (QNN HTP; on x86-64 its simulator) hands decode to the INT8 graphs of the same plan (its weights in
    `weight_form`) on the ONNX Runtime CPU EP (`NpuBackend.at_chunk`); the CPU EP stand-in decodes on its own graphs;
    float layers (provider None, called `name`) in torch. Decided at the edge (`methods.host_plan`), before any graph
    is made. `model`: the runtime's, whose GGUF's own Q4_1 / Q8_0 blocks the GEMVs decode from where every linear
    and the head has them (`native.gguf_forms`, `decode.gguf_blocks`: the file's weights, ~40% fewer bytes a step than
    the INT8 form). `decode_form` "q4_1" ("q4_1-all": the head too): where the file has float tensors instead, Q4_1
    blocks made from them (a 4-bit re-rounding the user opts into, as the 4-bit peers'); refused in one line where
    they cannot run."""
    if decode_form not in (None, *DECODE_FORMS):
        raise ConfigError(f"decode form must be one of {', '.join(DECODE_FORMS)}, got {decode_form!r}")
    made = None if decode_form in (None, "auto") else decode_form
    from hetero.npu.isa import cpu_form_for

    if provider is None or weight_form is None:
        if made is not None:
            raise ConfigError(f"--decode-form {made}: the {name} layers decode in torch, with no GEMVs to read it")
        return DecodePlacement("cpu", "torch", f"the prefill's {name} layers in torch, on the CPU already")
    from hetero.npu.nbits import DEFAULT_FORM, NBITS_ROWS

    # decode steps of up to NBITS_ROWS rows (every token-tree size): MatMulNBits graphs (`npu.nbits`: no shadow
    # corrections; a whole step 0.77x the INT8 step at one row, 0.92-0.95x at eight, docs/journal.md); larger chunks
    # keep the INT8 graphs, whose GEMM grows more slowly with the rows
    # hetero's own int8 GEMVs in the same form where this CPU has AVX-512 VNNI (`native.gemv`), else the graphs
    from hetero.native import gemv

    why = gemv.unavailable(cfg, build=False)
    form = gemv.describe() if why is None else f"{DEFAULT_FORM.describe()} (not hetero's int8 GEMVs: {why})"
    kernel = "gemv" if why is None else "nbits"
    if why is None and model is not None:

        blocks_why = gguf_forms.unavailable(model)
        if made is not None and blocks_why is not None:  # the file's own blocks, where it has them, are the same
            blocks_why = gguf_forms.unavailable(model, made)
            if blocks_why is not None:
                raise ConfigError(f"--decode-form {made}: {made} blocks cannot decode this model: {blocks_why}")
        else:
            made = None
        form, kernel = ((gguf_forms.describe(made), "blocks") if blocks_why is None else
                        (f"{form} (not the GGUF's own blocks: {blocks_why})", "gemv"))
    elif made is not None:
        raise ConfigError(f"--decode-form {made}: hetero's GEMVs cannot run here: {why or 'the runtime has no model file'}")
    small = {"small_rows": NBITS_ROWS, "small_form": form, "small_kernel": kernel, "made": made}
    if provider.device == "cpu":
        return DecodePlacement("cpu", provider.name, f"the NPU lane is this CPU EP, so its own INT8 graphs at "
                                                     f"decode sizes (weight form {weight_form})", **small)
    where = " (the HTP simulator)" if provider.name.startswith("qnn") and platform.machine() == "x86_64" else ""
    return DecodePlacement("cpu", "ort-cpu", f"the prefill's NPU lane is {provider.name}{where} and a decode step is "
                           f"memory-bound, so the same plan's INT8 graphs on the CPU EP, its {weight_form} "
                           f"weights in this CPU's exact form {cpu_form_for(weight_form)}", **small)


LAYOUTS = ("layers", "lanes")
LAYOUT_VERSION = 1


def layout_path(host: str | None = None) -> Path:
    """This host's measured layouts (`hetero npu layout` writes them)."""
    return user_profiles_dir() / "layout" / f"prefill_layout_{host or socket.gethostname()}.json"


def layout_key(model, chunk: int, threads: int) -> str:
    """What a measured layout holds for: the model (its file), C and the thread count."""
    return f"{model.name}-{model.fingerprint[:12]}-C{chunk}-{threads}t"


def record_layout(key: str, ms: dict[str, dict[int, float]], path: Path | None = None) -> dict:
    """Record the measured prefill ms of each layout per prompt length; the winner is the faster in total."""
    if set(ms) != set(LAYOUTS):
        raise ConfigError(f"a measured layout needs the times of {LAYOUTS}, got {sorted(ms)}")
    total = {mode: sum(t.values()) for mode, t in ms.items()}
    entry = {"key": key, "ms": {m: {str(n): round(v, 1) for n, v in t.items()} for m, t in ms.items()},
             "winner": min(total, key=total.get)}
    path = path or layout_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    old = _read(path)
    table = {"version": LAYOUT_VERSION, "entries": [e for e in old.get("entries", []) if e.get("key") != key] + [entry]}
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(table, indent=1))
    return entry


def recorded_layout(key: str, path: Path | None = None) -> dict | None:
    """The entry `record_layout` wrote for `key` on this host, None when it was not measured."""
    table = _read(path or layout_path())
    if table.get("version") != LAYOUT_VERSION:
        return None
    return next((e for e in table.get("entries", []) if e.get("key") == key and e.get("winner") in LAYOUTS), None)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def prefill_layout(cfg, provider_device: str, threads: int, measured: dict | None = None,
                   attention: str = "auto") -> PrefillLayout:
    """The layout of a prefill whose static graphs run on `provider_device` ("cpu": the CPU EP standing in for the
    NPU; "npu") with `threads` cores: an NPU keeps §3.4's lanes; on the CPU, this host's measurement (`measured`,
    a `recorded_layout` entry) decides, else the rule of the module docstring. attention: the whole-layer graphs'
    (`GraphOptions.attention`): a model whose attention the GroupQueryAttention node lacks (QK-norm, a local RoPE
    base) runs whole layers only around the BF16 kernel ("auto", "bf16")."""
    from hetero.attention import gqa_supported

    if provider_device != "cpu":
        return PrefillLayout("lanes", "the NPU lane is an NPU beside the CPU: its graphs overlap attention on the "
                                      "CPU lane (mllm-NPU §3.4)")
    lacks = gqa_supported(cfg)
    if lacks is not None:
        from hetero.native.attention import unavailable

        kernel = "the method asks for the node" if attention == "gqa" else unavailable(cfg)
        if kernel is not None:
            return PrefillLayout("lanes", f"this model's attention ({lacks}) has no in-graph kernel and hetero's BF16 "
                                          f"kernel does not run it ({kernel}), so it runs on the CPU lane beside the "
                                          f"INT8 graphs")
    if measured is not None:
        ms = "; ".join(f"{m}: " + ", ".join(f"{v:.0f} ms at {n}" for n, v in t.items()) for m, t in measured["ms"].items())
        return PrefillLayout(measured["winner"], f"measured on this host ({ms}; `hetero npu layout`)")
    runs = ("chunk i's layers on lane i mod 2, half the cores each, as a wavefront" if threads >= 2
            else "on its core")
    return PrefillLayout("layers", f"the NPU lane is this CPU's cores (the ONNX Runtime CPU EP): two lanes would split "
                                   f"its {threads} cores and hand ~90 subgraphs a chunk between them, so each layer "
                                   f"is one graph, {runs} (not measured on this host: `hetero npu layout`)")
