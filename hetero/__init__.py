"""hetero: fast LLM prefill on NPU + CPU/GPU, after mllm-NPU (chunk-sharing graphs, shadow outliers,
out-of-order subgraph scheduling)."""

from hetero.config import ModelConfig
from hetero.errors import HeteroError
from hetero.kv_cache import KVCache
from hetero.loader import Model, load_model
from hetero.runtime import PrefillResult, Runtime

__all__ = ["HeteroError", "KVCache", "Model", "ModelConfig", "PrefillResult", "Runtime", "load_model"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """`hetero.Service` (the stateful service, `hetero.serve`) is imported on first use."""
    if name == "Service":
        from hetero.serve import Service

        return Service
    raise AttributeError(f"module 'hetero' has no attribute {name!r}")
