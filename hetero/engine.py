"""Build a `Runtime` for a named backend: the one place the CLI and the benchmarks choose how to run.

| backend | static subgraphs (`qkv`, `o_ffn`) | outliers | dispatch |
|---|---|---|---|
| `hetero` (default) | INT8 ONNX graphs on the NPU lane (ONNX Runtime CPU EP standing in for the NPU) | shadow + pruning | out of order (`rank`) |
| `hetero-qnn` | INT8 QDQ graphs on QNN HTP (on x86 the HTP *simulator*: correct, slow) | shadow + pruning | out of order |
| `hetero-inorder` | as `hetero` | shadow + pruning | in order (Fig. 13a) |
| `hetero-noshadow` | as `hetero` | clipped, no shadow (ablation) | out of order |
| `float` | float reference (torch) | — | in program order, one thread |
| `float-ooo` | float reference (torch) | — | out of order |

The quantized backends need the model's calibration (mllm-NPU §3.3, offline): the first use computes it
on the shipped calibration text and caches it beside the model (`hetero calibrate` does it explicitly).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hetero.backend import FloatBackend, LayerBackend
from hetero.errors import ConfigError
from hetero.loader import Model
from hetero.runtime import Runtime

if TYPE_CHECKING:
    from hetero.outliers.plan import QuantPlan


def _float(model: Model, chunk: int, threads: int | None, weight_form: str | None) -> LayerBackend:
    return FloatBackend(model.config, model.weights)


def quant_plan(model: Model, lane: str = "cpu", prune_fraction: float = 0.85,
               weight_form: str | None = None) -> "QuantPlan":
    """The quantization plan of `model` for a lane: calibrated scales, shadow sites, INT8 weights.

    weight_form (`hetero.outliers.quantize.WEIGHT_FORMS`): None picks this CPU's exact and fast form on the
    CPU EP (`hetero.npu.isa`: 8-bit weights u8·s8 with VNNI, u8·u8 on AVX2); an NPU (QNN HTP) runs the
    paper's 8-bit weights.
    """
    from hetero.npu.isa import resolve_weight_form
    from hetero.outliers.calibrate import ensure_calibration
    from hetero.outliers.plan import build_plan

    form = resolve_weight_form(weight_form) if lane == "cpu" else (weight_form or "w8-u8u8")
    return build_plan(model, ensure_calibration(model, progress=True), prune_fraction=prune_fraction,
                      weight_form=form)


def _npu(lane: str, prune_fraction: float = 0.85) -> Callable[[Model, int, int | None, str | None], LayerBackend]:
    def make(model: Model, chunk: int, threads: int | None, weight_form: str | None) -> LayerBackend:
        from hetero.npu.backend import NpuBackend

        plan = quant_plan(model, lane, prune_fraction, weight_form)
        return NpuBackend(model, plan, chunk=chunk, lane=lane, intra_op_threads=threads or 2)

    return make


@dataclass(frozen=True, slots=True)
class BackendSpec:
    # (model, chunk, threads, weight_form) -> layer backend
    make: Callable[[Model, int, int | None, str | None], LayerBackend]
    policy: str | None  # default dispatch policy; None = in program order on the calling thread
    doc: str


BACKENDS: dict[str, BackendSpec] = {
    "hetero": BackendSpec(_npu("cpu"), "rank", "INT8 graphs (ORT CPU EP as NPU lane), shadow outliers, out of order"),
    "hetero-qnn": BackendSpec(_npu("qnn"), "rank", "INT8 QDQ graphs on QNN HTP (simulator on x86), out of order"),
    "hetero-inorder": BackendSpec(_npu("cpu"), "in_order", "as hetero, dispatched in order"),
    "hetero-noshadow": BackendSpec(_npu("cpu", prune_fraction=1.0), "rank", "as hetero, outliers clipped (no shadow)"),
    "float": BackendSpec(_float, None, "float reference, in program order"),
    "float-ooo": BackendSpec(_float, "rank", "float reference, out of order"),
}
DEFAULT_BACKEND = "hetero"


def make_runtime(model: Model, backend: str = DEFAULT_BACKEND, chunk: int = 256, threads: int | None = None,
                 policy: str | None = None, weight_form: str | None = None) -> Runtime:
    """A runtime for `backend`; `policy` overrides the backend's default dispatch policy; `weight_form`
    forces the INT8 weight form of the quantized backends (None: this CPU's, `hetero.npu.isa`).

    Threads: the NPU lane's ONNX Runtime sessions get `threads` (default: all cores). When lanes run
    concurrently, torch (the CPU lane: attention, shadow outliers) gets half of them, so the two lanes
    do not oversubscribe the cores; on the 2-core development machine this split measured best (NPU 2 +
    CPU 1: 564 tokens/s at 1024 tokens, vs 533 for 2 + 2 and 432 for 1 + 2).
    """
    spec = BACKENDS.get(backend)
    if spec is None:
        raise ConfigError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    threads = threads or os.cpu_count() or 1
    policy = policy or spec.policy
    overlapped = policy is not None and spec.make is not _float
    torch.set_num_threads(max(1, threads // 2) if overlapped else threads)
    return Runtime(model, chunk=chunk, backend=spec.make(model, chunk, threads, weight_form),
                   policy=policy)
