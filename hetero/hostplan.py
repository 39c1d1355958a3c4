"""The host plan: what runs on this host for one runtime, each decision with its reason, resolved once at the edge
(`methods.host_plan`) and then passed down. The runtime, its executor, its backend and its decode step read it and
decide nothing again; `hetero info` and `hetero -v run` print it (`HostPlan.lines`).

Its values are plain data (this is a core module): the techniques that decide (`npu.placement`,
`npu.graph_backend.attention_kernel` / `native_ops_why`, `threads.ExecutionPlan.for_host`) are asked by `methods`,
which writes their answers here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hetero.chunking import ChunkRule
from hetero.threads import ExecutionPlan


@dataclass(frozen=True, slots=True)
class Choice:
    """One decision of the plan: what runs, and why (a short line)."""

    value: str
    reason: str


@dataclass(frozen=True, slots=True)
class PrefillLayout:
    """How a runtime's prefill runs on this host (`npu.placement`): "layers" (a graph per layer, attention and shadows
    inside; chunks alternate between two lanes, `sched.wavefront`) or "lanes" (§3.4's subgraphs on the NPU and CPU
    lanes, out of order)."""

    mode: Literal["layers", "lanes"]
    reason: str

    def describe(self) -> str:
        return f"prefill as {self.mode}: {self.reason}"


@dataclass(frozen=True, slots=True)
class DecodePlacement:
    """Where a runtime's decode steps run, decided with its prefill placement (`npu.placement.decode_placement`).

    A decode step is a few rows against every weight: bound by memory bandwidth, where an NPU gains little,
    and the QNN HTP simulator decoded 0.9 tokens/s where the CPU EP decodes 36. mllm-NPU prefills
    on the NPU and "relies on a CPU backend for decoding" (§5, end-to-end latency); so does hetero.
    """

    device: Literal["cpu", "npu"]  # the hardware that runs the decode steps' layers
    engine: str  # what runs them: a provider ("ort-cpu": INT8 graphs of the prefill's plan), or "torch" (float)
    reason: str
    small_rows: int = 0  # steps of up to this many rows run the `small_form` graphs instead (0: none)
    small_form: str = ""  # what those graphs are, in words (`npu.nbits`, `native.gemv`)
    # what runs them: "blocks" (hetero's GEMVs over the GGUF's own blocks, `decode.gguf_blocks`), "gemv" (its int8
    # GEMVs, `native.gemv`) or "nbits" (the graphs)
    small_kernel: str = "nbits"
    # "blocks" from float tensors: the form hetero makes them in (`gguf_forms.MADE`, `--decode-form`), None: the file's
    made: str | None = None

    def describe(self) -> str:
        small = f"; steps of 1-{self.small_rows} rows: {self.small_form}" if self.small_rows else ""
        return f"decode on the {self.device}, {self.engine}: {self.reason}{small}"


@dataclass(frozen=True, slots=True)
class HostPlan:
    """Every decision of how one runtime runs on this host. Invariant: `chunks.chunk` is the runtime's C, read by the
    runtime, its buffers and its executor (never stored beside it); a backend of fixed-shape graphs is checked
    against it when the runtime is made."""

    method: Choice  # the method that runs (the default falls back to "float" for a model its INT8 path lacks)
    chunks: ChunkRule  # C and how a prompt is cut (the wavefront's chunks of equal work, up to 1.5·C rows)
    layout: PrefillLayout | None  # None: float layers, no graphs
    npu: Choice  # the provider of the static graphs ("none" for float layers)
    executor: Choice  # "in-order", "wavefront" or "out-of-order"
    attention: Choice  # "bf16" / "gqa" inside whole-layer graphs, "chunk" (`attention.ChunkAttention`, the CPU lane)
    glue: Choice  # the float ops between the INT8 linears: "native" (hetero's ops), "onnx" (nodes), "torch"
    weights: Choice  # the INT8 weights' form (`npu.isa.WEIGHT_FORMS`), or "float"
    decode: DecodePlacement | None  # where decode steps run (`small_kernel`: the decode kernel); None: the backend's
    execution: ExecutionPlan  # thread shares
    execution_reason: str
    policy: str | None = None  # the out-of-order executor's dispatch policy

    @classmethod
    def given(cls, chunks: ChunkRule, execution: ExecutionPlan, decode: DecodePlacement | None = None,
              layout: PrefillLayout | None = None, backend: str = "", executor: object = None) -> "HostPlan":
        """The plan of a runtime its caller assembled (`Runtime(model, chunk, backend, ...)`): its parts as given,
        nothing decided for this host."""
        given = "as its caller made the runtime (`Runtime(...)`)"
        return cls(
            method=Choice("given", given), chunks=chunks, layout=layout, npu=Choice(backend, given),
            executor=Choice(type(executor).__name__ if executor is not None else "in-order",
                            given if executor is not None else "program order on the calling thread (the default)"),
            attention=Choice("the backend's", given), glue=Choice("the backend's", given),
            weights=Choice("the backend's", given), decode=decode, execution=execution, execution_reason=given)

    @property
    def chunk(self) -> int:
        """The chunk length C."""
        return self.chunks.chunk

    @property
    def weight_form(self) -> str | None:
        """The INT8 weights' form; None for float layers or a runtime its caller assembled."""
        return None if self.weights.value in ("float", "the backend's") else self.weights.value

    def decisions(self) -> dict[str, Choice]:
        """Each decision with its reason, in the order a reader follows a prefill and then a decode."""
        layout = (Choice(self.layout.mode, self.layout.reason) if self.layout is not None
                  else Choice("float", "the method runs torch's float layers: no graphs to lay out"))
        e = self.execution
        threads = (f"{e.threads} cores; a lane {e.lane_threads}, alone {e.alone_threads}; ONNX Runtime pool per "
                   f"{e.ort_pool}; decode helper {'on' if e.decode_helper else 'off'}")
        d = self.decode
        decode = (Choice("the backend's own engines", "no decode placement given") if d is None else
                  Choice(f"{d.device}, {d.engine}" + (f"; steps of 1-{d.small_rows} rows: {d.small_kernel}"
                                                      if d.small_rows else ""),
                         d.reason + (f" ({d.small_form})" if d.small_rows else "")))
        return {
            "method": self.method,
            "chunks": Choice(self.chunks.describe(), "the wavefront's lanes each get chunks of equal work"
                             if self.chunks.lanes else "the method's or the command's C"),
            "layout": layout,
            "npu": self.npu,
            "executor": self.executor if self.policy is None else Choice(f"{self.executor.value} ({self.policy})",
                                                                        self.executor.reason),
            "attention": self.attention,
            "glue": self.glue,
            "weights": self.weights,
            "decode": decode,
            "threads": Choice(threads, self.execution_reason),
        }

    def lines(self) -> list[str]:
        """One line per decision: name, what, why (`hetero info`, `hetero -v run`)."""
        return [f"{name:<10} {c.value}; why: {c.reason}" for name, c in self.decisions().items()]

    def to_dict(self) -> dict[str, dict[str, str]]:
        """The decisions as JSON (`hetero info --json`)."""
        return {name: {"value": c.value, "reason": c.reason} for name, c in self.decisions().items()}
