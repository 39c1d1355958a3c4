"""Build a `Runtime` for a named backend: the one place the CLI and the benchmarks choose how to run.

| backend | static subgraphs (`qkv`, `o_ffn`) | dispatch |
|---|---|---|
| `float` | float reference (torch) | in program order, one thread |
| `float-ooo` | float reference (torch) | out of order, NPU-lane and CPU-lane workers |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hetero.backend import FloatBackend, LayerBackend
from hetero.errors import ConfigError
from hetero.loader import Model
from hetero.runtime import Runtime


@dataclass(frozen=True, slots=True)
class BackendSpec:
    make: Callable[[Model, int | None], LayerBackend]  # (model, threads) -> layer backend
    policy: str | None  # default dispatch policy; None = in program order on the calling thread
    doc: str


BACKENDS: dict[str, BackendSpec] = {
    "float": BackendSpec(lambda m, t: FloatBackend(m.config, m.weights), None, "float reference, in order"),
    "float-ooo": BackendSpec(lambda m, t: FloatBackend(m.config, m.weights), "rank", "float reference, out of order"),
}
DEFAULT_BACKEND = "float"


def make_runtime(model: Model, backend: str = DEFAULT_BACKEND, chunk: int = 256, threads: int | None = None,
                 policy: str | None = None) -> Runtime:
    """A runtime for `backend`; `policy` overrides the backend's default dispatch policy."""
    spec = BACKENDS.get(backend)
    if spec is None:
        raise ConfigError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if threads:
        torch.set_num_threads(threads)
    return Runtime(model, chunk=chunk, backend=spec.make(model, threads), policy=policy or spec.policy)
