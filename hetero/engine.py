"""Build a `Runtime` for a named backend: the one place the CLI and the benchmarks choose how to run.

- `float`: the float reference for every subgraph, chunk by chunk in order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hetero.errors import ConfigError
from hetero.loader import Model
from hetero.runtime import Runtime


def _float(model: Model, chunk: int, threads: int | None) -> Runtime:
    return Runtime(model, chunk=chunk)


BACKENDS: dict[str, Callable[[Model, int, int | None], Runtime]] = {"float": _float}
DEFAULT_BACKEND = "float"


def make_runtime(model: Model, backend: str = DEFAULT_BACKEND, chunk: int = 256, threads: int | None = None) -> Runtime:
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if threads:
        torch.set_num_threads(threads)
    return BACKENDS[backend](model, chunk, threads)
