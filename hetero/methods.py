"""Methods: named ways to run a prefill (layer ops + dispatch policy), and `make_runtime` to build one.

The composition layer: the only module that picks techniques (`outliers/`, `npu/`, `sched/`) and wires
them into a core `Runtime`, and the one place that sets torch's thread count. Quantized methods need
the model's calibration (mllm-NPU §3.3, offline): the first use computes and caches it.
The table of methods and the measured thread split are in docs/design.md.
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
from hetero.serve.service import Service
from hetero.serve.store import StoreConfig

if TYPE_CHECKING:
    from hetero.outliers.plan import QuantPlan


def use_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count (None: all cores); returns the count set."""
    n = threads or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def quant_plan(model: Model, provider: str = "cpu", prune_fraction: float = 0.85,
               weight_form: str | None = None) -> "QuantPlan":
    """The quantization plan of `model` for a provider ("cpu" or "qnn"): calibrated scales, shadow sites, INT8 weights.

    weight_form (`hetero.outliers.quantize.WEIGHT_FORMS`): None picks this CPU's exact and fast form on the
    CPU EP (`hetero.npu.isa`: 8-bit weights u8·s8 with VNNI, u8·u8 on AVX2); an NPU (QNN HTP) runs the
    paper's 8-bit weights.
    """
    from hetero.npu.isa import resolve_weight_form
    from hetero.outliers.calibrate import ensure_calibration
    from hetero.outliers.pruning import plan_from_calibration

    form = resolve_weight_form(weight_form) if provider == "cpu" else (weight_form or "w8-u8u8")
    return plan_from_calibration(model, ensure_calibration(model, progress=True), prune_fraction=prune_fraction,
                                 weight_form=form)


def _float(model: Model, chunk: int, threads: int | None, weight_form: str | None) -> LayerBackend:
    return FloatBackend(model.config, model.weights)


def _npu(provider: str, prune_fraction: float = 0.85) -> Callable[[Model, int, int | None, str | None], LayerBackend]:
    def make(model: Model, chunk: int, threads: int | None, weight_form: str | None) -> LayerBackend:
        from hetero.npu.backend import NpuBackend

        plan = quant_plan(model, provider, prune_fraction, weight_form)
        return NpuBackend(model, plan, chunk=chunk, provider=provider, intra_op_threads=threads or 2)

    return make


@dataclass(frozen=True, slots=True)
class Method:
    # (model, chunk, threads, weight_form) -> the layer ops
    make: Callable[[Model, int, int | None, str | None], LayerBackend]
    policy: str | None  # default dispatch policy; None = in program order on the calling thread
    doc: str


METHODS: dict[str, Method] = {
    "hetero": Method(_npu("cpu"), "rank", "INT8 graphs (ORT CPU EP as NPU lane), shadow outliers, out of order"),
    "hetero-qnn": Method(_npu("qnn"), "rank", "INT8 QDQ graphs on QNN HTP (simulator on x86), out of order"),
    "hetero-inorder": Method(_npu("cpu"), "in_order", "as hetero, dispatched in order"),
    "hetero-noshadow": Method(_npu("cpu", prune_fraction=1.0), "rank", "as hetero, outliers clipped (no shadow)"),
    "float": Method(_float, None, "float reference, in program order"),
    "float-ooo": Method(_float, "rank", "float reference, out of order"),
}
DEFAULT_METHOD = "hetero"


def make_runtime(model: Model, method: str = DEFAULT_METHOD, chunk: int = 256, threads: int | None = None,
                 policy: str | None = None, weight_form: str | None = None) -> Runtime:
    """A runtime for `method`; `policy` overrides the method's default dispatch policy; `weight_form` forces
    the INT8 weight form of the quantized methods (None or "auto": this CPU's, `hetero.npu.isa`).

    Threads: the provider's ONNX Runtime sessions (the npu lane) get `threads` (default: all cores); when
    lanes overlap, torch (the cpu lane) gets half of them so the lanes do not oversubscribe the cores.
    """
    spec = METHODS.get(method)
    if spec is None:
        raise ConfigError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    threads = threads or os.cpu_count() or 1
    policy = policy or spec.policy
    overlapped = policy is not None and spec.make is not _float
    use_threads(max(1, threads // 2) if overlapped else threads)
    executor = None
    if policy is not None:
        from hetero.sched.executor import OutOfOrderExecutor

        executor = OutOfOrderExecutor(model.config.n_layers, chunk, policy)
    return Runtime(model, chunk=chunk, backend=spec.make(model, chunk, threads, weight_form),
                   executor=executor)


def make_service(model: Model, method: str = DEFAULT_METHOD, chunk: int = 256, threads: int | None = None,
                 store: StoreConfig | None = None, **options: int) -> Service:
    """A `hetero.serve.Service` (contexts, prefix reuse, the chunk K/V store) over a runtime for `method`.

    `options`: max_contexts_per_client, max_active, max_queue (see `Service`).
    """
    return Service(make_runtime(model, method, chunk, threads), store, **options)
