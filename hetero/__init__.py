"""hetero: fast LLM prefill on NPU + CPU/GPU, after mllm-NPU (chunk-sharing graphs, shadow outliers,
out-of-order subgraph scheduling).

The public names load on first use (PEP 562), so `import hetero` (and the `hetero` command's own start) loads
no torch: an entry point may still choose OpenMP's wait policy before torch reads it (`hetero.threads`).
Importing hetero changes no environment variable.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetero.config import ModelConfig
    from hetero.errors import HeteroError
    from hetero.kv_cache import KVCache
    from hetero.loader import Model, load_model
    from hetero.methods import METHODS, Service, make_runtime, make_service
    from hetero.runtime import PrefillResult, Runtime

_EXPORTS = {"ModelConfig": "hetero.config", "HeteroError": "hetero.errors", "KVCache": "hetero.kv_cache",
            "Model": "hetero.loader", "load_model": "hetero.loader", "METHODS": "hetero.methods",
            "Service": "hetero.methods", "make_runtime": "hetero.methods", "make_service": "hetero.methods",
            "PrefillResult": "hetero.runtime", "Runtime": "hetero.runtime"}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """A public name (imported from its module on first use), or a submodule (`hetero.errors`)."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
