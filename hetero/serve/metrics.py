"""The service's Prometheus metrics (`GET /metrics`, text format via `prometheus_client`).

Named after vLLM's where they mean the same (prefix-cache queried and hit tokens, time to first token,
inter-token latency), under the `hetero_` prefix. One registry per `Service`, so several services in one
process (tests, benchmarks) do not share counters. Counters and histograms are updated by the engine
thread as requests finish; the K/V bytes per tier and the queue are gauges read at scrape time from values
the engine thread last published (the store is never walked from the HTTP thread).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "ServeMetrics"]

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
TIERS = ("ram_float", "ram_compressed", "disk")


class ServeMetrics:
    """The counters, histograms and gauges of one service."""

    def __init__(self, load: Callable[[], dict]):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("hetero_requests", "Requests finished, by outcome (ok, or the error's class)",
                                ["outcome"], registry=r)
        self.prompt_tokens = Counter("hetero_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("hetero_generation_tokens", "Tokens generated", registry=r)
        self.prefill_tokens = Counter("hetero_prefill_tokens", "Prompt tokens prefilled (not taken from the cache)",
                                      registry=r)
        self.prefix_queries = Counter("hetero_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("hetero_prefix_cache_hits",
                                   "Prompt tokens whose K/V came from the prefix cache", registry=r)
        self.flushes = Counter("hetero_prefix_cache_flushes", "Prefix cache flushes", registry=r)
        self.ttft = Histogram("hetero_time_to_first_token_seconds", "Submission to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("hetero_inter_token_latency_seconds", "Time between two streamed tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.prefill_tps = Histogram("hetero_prefill_tokens_per_second", "Prefill speed of each request",
                                     buckets=(50, 100, 200, 400, 800, 1200, 1600, 2400, 3200, 5000), registry=r)
        self.kv_bytes = Gauge("hetero_kv_cache_bytes", "Bytes of kept K/V by tier", ["tier"], registry=r)
        for t in TIERS:
            self.kv_bytes.labels(t).set(0)
        self.kv_budget = Gauge("hetero_kv_cache_budget_bytes", "RAM budget of kept K/V (0: unbounded)", registry=r)
        self.contexts = Gauge("hetero_contexts", "Active contexts", registry=r)
        queue = Gauge("hetero_queue_length", "Requests waiting for admission", registry=r)
        queue.set_function(lambda: load()["queued"])
        active = Gauge("hetero_active_requests", "Requests admitted and running", registry=r)
        active.set_function(lambda: load()["active"])

    def publish_store(self, stats: dict, contexts: int) -> None:
        """The store's bytes per tier (from `ChunkStore.stats`, on the engine thread)."""
        for t in TIERS:
            self.kv_bytes.labels(t).set(stats["bytes"][t])
        self.kv_budget.set(stats["budget_bytes"] or 0)
        self.contexts.set(contexts)

    def text(self) -> bytes:
        return generate_latest(self.registry)
