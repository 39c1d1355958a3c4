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


def _float(model: Model, chunk: int, threads: int | None) -> LayerBackend:
    return FloatBackend(model.config, model.weights)


def quant_plan(model: Model, provider: str = "cpu", prune_fraction: float = 0.85) -> "QuantPlan":
    """The quantization plan of `model` for a provider ("cpu" or "qnn"): calibrated scales, shadow sites, INT8 weights.

    On the CPU EP (standing in for the NPU), 7-bit weights let ONNX Runtime use its fast u8·s8 kernel
    exactly on AVX2 (`hetero.outliers.plan`); an NPU (QNN HTP) runs the paper's 8-bit weights.
    """
    from hetero.outliers.calibrate import ensure_calibration
    from hetero.outliers.pruning import plan_from_calibration
    from hetero.outliers.quantize import W_QMAX, W_QMAX_U8S8

    return plan_from_calibration(model, ensure_calibration(model, progress=True), prune_fraction=prune_fraction,
                      weight_qmax=W_QMAX_U8S8 if provider == "cpu" else W_QMAX)


def _npu(provider: str, prune_fraction: float = 0.85) -> Callable[[Model, int, int | None], LayerBackend]:
    def make(model: Model, chunk: int, threads: int | None) -> LayerBackend:
        from hetero.npu.backend import NpuBackend

        plan = quant_plan(model, provider, prune_fraction)
        return NpuBackend(model, plan, chunk=chunk, provider=provider, intra_op_threads=threads or 2)

    return make


@dataclass(frozen=True, slots=True)
class BackendSpec:
    make: Callable[[Model, int, int | None], LayerBackend]  # (model, chunk, threads) -> layer backend
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
                 policy: str | None = None) -> Runtime:
    """A runtime for `backend`; `policy` overrides the backend's default dispatch policy.

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
    executor = None
    if policy is not None:
        from hetero.sched.executor import OutOfOrderExecutor

        executor = OutOfOrderExecutor(model.config.n_layers, chunk, policy)
    return Runtime(model, chunk=chunk, backend=spec.make(model, chunk, threads), executor=executor)
