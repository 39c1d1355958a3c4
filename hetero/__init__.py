"""hetero: fast LLM prefill on NPU + CPU/GPU, after mllm-NPU (chunk-sharing graphs, shadow outliers,
out-of-order subgraph scheduling)."""

from hetero.threads import passive_openmp

passive_openmp()  # before anything imports torch: libgomp reads its wait policy once, when it loads

from hetero.config import ModelConfig  # noqa: E402
from hetero.errors import HeteroError  # noqa: E402
from hetero.kv_cache import KVCache  # noqa: E402
from hetero.loader import Model, load_model  # noqa: E402
from hetero.methods import METHODS, Service, make_runtime, make_service  # noqa: E402
from hetero.runtime import PrefillResult, Runtime  # noqa: E402

__all__ = ["METHODS", "HeteroError", "KVCache", "Model", "ModelConfig", "PrefillResult", "Runtime", "Service",
           "load_model", "make_runtime", "make_service"]
__version__ = "0.1.0"

