"""`hetero serve`: a stateful prefill service (LLMS + Pensieve) with persistent contexts, multi-turn K/V
reuse through a prefix index, and a memory-bounded chunk K/V store; `Service` is the Python API, and
`hetero.serve.http` its OpenAI-compatible HTTP front."""

from hetero.serve.service import ContextLimit, Reply, Service, UnknownContext, Usage
from hetero.serve.store import StoreConfig

__all__ = ["ContextLimit", "Reply", "Service", "StoreConfig", "UnknownContext", "Usage"]
