"""`Runtime.prefill`: a prompt → chunks → subgraphs → KV cache + last logits.

A subgraph G[i][j] of the prefill (mllm-NPU §3.4) is (chunk i, layer, kind); `PrefillJob.run` executes
one of them on the job's per-chunk buffers, so the same job can be driven in order (here) or out of
order by the scheduler. Chunks write their K/V in place into a preallocated `KVCache`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hetero import model as ref
from hetero.backend import FloatBackend, LayerBackend
from hetero.chunking import Chunk, padded_ids, plan_chunks
from hetero.errors import ConfigError
from hetero.kv_cache import KVCache
from hetero.loader import Model
from hetero.model import SUBGRAPH_KINDS

if TYPE_CHECKING:
    from hetero.sched.profile import Profile



@dataclass(slots=True)
class PrefillResult:
    """What a prefill hands to a decoding engine."""

    cache: KVCache  # length = start + n_tokens
    logits: torch.Tensor  # [vocab], of the last real token
    n_tokens: int  # new tokens prefilled
    start: int  # P: cached positions before this prefill
    chunk_ms: list[float]  # wall time from the prefill's start until each chunk's last subgraph ended
    total_ms: float
    schedule: object | None = None  # the executed schedule, when an out-of-order executor ran it

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / (self.total_ms / 1e3) if self.total_ms > 0 else float("inf")


@dataclass(slots=True)
class PrefillJob:
    """Buffers of one prefill; `run(i, layer, kind)` executes subgraph G[i][layer·3 + kind]."""

    runtime: "Runtime"
    cache: KVCache
    chunks: list[Chunk]
    h: list[torch.Tensor]  # per chunk: residual stream [C, hidden]
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = field(default_factory=list)
    attn: list[torch.Tensor | None] = field(default_factory=list)

    @torch.inference_mode()  # thread-local: lane worker threads need it too
    def run(self, i: int, layer: int, kind: str) -> None:
        rt, c = self.runtime, self.chunks[i]
        if kind == "qkv":
            self.qkv[i] = rt.backend.qkv(layer, self.h[i])
        elif kind == "attn":
            q, k, v = self.qkv[i]
            k_cache, v_cache = self.cache.layer(layer)
            self.attn[i] = ref.attention(rt.cfg, q, k, v, rt.rope, k_cache, v_cache, c.start, c.n_valid)
        elif kind == "o_ffn":
            self.h[i] = rt.backend.o_ffn(layer, self.attn[i], self.h[i])
        else:
            raise ValueError(f"unknown subgraph kind {kind!r}")


class Runtime:
    """Chunked prefill of one model. `backend` runs the static subgraphs (float reference by default)."""

    def __init__(
        self,
        model: Model,
        chunk: int = 256,
        backend: LayerBackend | None = None,
        max_context: int | None = None,
        policy: str | None = None,
        profile: "Profile | None" = None,
        placement: tuple[tuple[str, str], ...] = (("qkv", "npu"), ("attn", "cpu"), ("o_ffn", "npu")),
    ):
        """`policy` None runs subgraphs in program order on the calling thread; a policy name from
        `hetero.sched.policy.POLICIES` runs them out of order on one worker per lane (mllm-NPU §3.4),
        dispatching on the costs of `profile` (default: this host's measured profile).
        """
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
            raise ConfigError(f"chunk must be a positive integer, got {chunk!r}")
        self.model, self.cfg, self.chunk = model, model.config, chunk
        ctx = self.cfg.context_length
        if max_context is not None and not 0 < max_context <= ctx:
            raise ConfigError(f"max_context must be in [1, {ctx}], got {max_context}")
        self.max_context = max_context or ctx
        self.backend = backend or FloatBackend(self.cfg, model.weights)
        self.rope = ref.RopeTable(self.cfg, ctx + chunk)  # + chunk: padded rows of the last chunk
        self.policy, self.placement = policy, tuple(placement)
        self._ooo = None
        if policy is not None:
            from hetero.sched.runner import OutOfOrderRunner

            self._ooo = OutOfOrderRunner(self.cfg.n_layers, chunk, policy, profile, self.placement)

    def close(self) -> None:
        """Stop the lane workers of the out-of-order executor (if any)."""
        if self._ooo is not None:
            self._ooo.close()

    def new_cache(self, capacity: int | None = None) -> KVCache:
        return KVCache(self.cfg, capacity or self.max_context)

    def check_ids(self, ids: Sequence[int] | torch.Tensor, start: int = 0) -> torch.Tensor:
        """Validate token ids at the edge: 1-D, non-empty, in the vocabulary, within the context."""
        t = torch.as_tensor(ids) if not isinstance(ids, torch.Tensor) else ids
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 1:
            raise ConfigError(f"ids must be a 1-D sequence of token ids, got shape {tuple(t.shape)}")
        if t.numel() == 0:
            raise ConfigError("ids is empty: the prompt must contain at least one token")
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ConfigError(f"ids must be integers, got dtype {t.dtype}")
        bad = ((t < 0) | (t >= self.cfg.vocab)).nonzero()
        if bad.numel():
            j = int(bad[0, 0])
            raise ConfigError(f"token id {int(t[j])} at index {j} is out of range [0, {self.cfg.vocab})")
        if start + t.numel() > self.max_context:
            raise ConfigError(
                f"prompt of {t.numel()} tokens (+{start} cached) exceeds the context length {self.max_context}"
            )
        return t.long()

    def start_job(self, ids: torch.Tensor, cache: KVCache) -> PrefillJob:
        chunks = plan_chunks(ids.numel(), self.chunk, cache.length)
        h = [ref.embed(self.model.weights, padded_ids(ids, c, self.chunk, cache.length)) for c in chunks]
        return PrefillJob(self, cache, chunks, h, [None] * len(chunks), [None] * len(chunks))

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int] | torch.Tensor, cache: KVCache | None = None) -> PrefillResult:
        """Prefill `ids`, continuing `cache` at position P = cache.length if given (the next turn)."""
        start = cache.length if cache is not None else 0
        ids = self.check_ids(ids, start)
        if cache is None:
            cache = self.new_cache()
        cache.reserve(ids.numel())
        t0 = time.perf_counter()
        job = self.start_job(ids, cache)
        if self._ooo is not None:
            schedule, chunk_ms = self._ooo.run(job)
            return self.finish(job, chunk_ms, t0, schedule)
        chunk_ms = []
        for i in range(len(job.chunks)):
            for layer in range(self.cfg.n_layers):
                for kind in SUBGRAPH_KINDS:
                    job.run(i, layer, kind)
            chunk_ms.append((time.perf_counter() - t0) * 1e3)
        return self.finish(job, chunk_ms, t0)

    def finish(self, job: PrefillJob, chunk_ms: list[float], t0: float, schedule: object | None = None) -> PrefillResult:
        last = job.chunks[-1]
        h_last = job.h[-1][last.n_valid - 1]
        logits = ref.logits(self.cfg, self.model.weights, h_last)
        n = sum(c.n_valid for c in job.chunks)
        start = job.cache.length
        job.cache.length = start + n  # only now: a failed prefill leaves the cache's length unchanged
        total_ms = (time.perf_counter() - t0) * 1e3
        return PrefillResult(job.cache, logits, n, start, chunk_ms, total_ms, schedule)
