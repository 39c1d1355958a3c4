"""hetero: fast LLM prefill on NPU + CPU/GPU, after mllm-NPU (chunk-sharing graphs, shadow outliers,
out-of-order subgraph scheduling)."""

from hetero.config import ModelConfig
from hetero.errors import HeteroError
from hetero.kv_cache import KVCache
from hetero.loader import Model, load_model
from hetero.methods import METHODS, Service, make_runtime, make_service
from hetero.runtime import PrefillResult, Runtime

__all__ = ["METHODS", "HeteroError", "KVCache", "Model", "ModelConfig", "PrefillResult", "Runtime", "Service",
           "load_model", "make_runtime", "make_service"]
__version__ = "0.1.0"

