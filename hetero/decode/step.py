"""A decode step: a few tokens (one, or a token tree) through every layer over a runtime's KV cache.

Static subgraphs run on the runtime's backend; an INT8 backend built for prefill chunks (C = 256) is
rebuilt at the small decode sizes (C = 1 and the tree sizes) from the same quantization plan and the
same graph cache. Attention runs on the CPU lane with per-row positions and the tree mask. K/V of the
rows are written in place at cache rows `length .. length+n-1`; the caller decides what stays.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from hetero import model as ref
from hetero.backend import LayerBackend
from hetero.decode.attnpool import AttentionPool
from hetero.decode.bound import BoundStep
from hetero.decode.head import FloatHead, Int8Head
from hetero.decode.rowattn import row_attention
from hetero.decode.tree import TokenTree
from hetero.errors import ConfigError
from hetero.kv_cache import KVCache
from hetero.runtime import Runtime
from hetero.threads import shared_ort_pool, usable_cores

TREE_SIZES = (1, 2, 4, 8)  # static chunk sizes of the INT8 decode graphs (2: a one-token draft, LLMCad §3.3)
# Threads of an INT8 decode step (its graph sessions and torch while it runs). A step is ~150 small ops
# (graph runs, per-layer attention, shadow corrections) of a few to ~80 µs each; with two threads each op
# wakes a sleeping pool thread (neither pool spins: `npu.providers`, `hetero.threads`), which costs more
# than the second core's extra memory bandwidth gains (docs/design.md, "Decode").
DECODE_THREADS = 1


def default_attention_threads() -> int:
    """Threads of an INT8 step's attention and LM head: 2 (a helper thread that spins only while a step runs,
    `attnpool`; same logits as 1) when the process may use two cores, but not beside a shared ONNX Runtime pool,
    whose threads spin between runs too: both spinning on two cores made a step at context 1024 14.2 ms instead
    of 10.3 (docs/design.md, "Decoding")."""
    return 1 if shared_ort_pool() or usable_cores() < 2 else 2


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to n for the block, then restored."""
    before = torch.get_num_threads()
    if before != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if before != n:
            torch.set_num_threads(before)


class DecodeStep:
    """Forward passes of decode-sized chunks for one runtime (`DecodeStep.of(runtime)` shares one)."""

    _shared: "weakref.WeakKeyDictionary[Runtime, DecodeStep]" = weakref.WeakKeyDictionary()

    def __init__(self, runtime: Runtime, head: str = "auto", threads: int = DECODE_THREADS,
                 attention_threads: int | None = None):
        if threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        attention_threads = default_attention_threads() if attention_threads is None else attention_threads
        if attention_threads not in (1, 2):
            raise ConfigError(f"attention_threads must be 1 or 2, got {attention_threads}")
        self.runtime, self.cfg, self.model = runtime, runtime.cfg, runtime.model
        self.static = hasattr(runtime.backend, "plan") and hasattr(runtime.backend, "provider")  # NpuBackend
        self.threads = threads  # the INT8 lane's (the float lane keeps the runtime's: its step is a few big GEMVs)
        self._backends: dict[int, LayerBackend] = {}
        self.costs: dict[int, float] = {}  # chunk size → measured ms of a step (shared by decodes)
        self._bound: dict[int, BoundStep] = {}  # static lanes: chunk size → its bound graphs
        self.pool = AttentionPool() if self.static and attention_threads == 2 else None
        if self.pool is not None:  # the helper thread ends with this step object
            weakref.finalize(self, self.pool.close)
        if head == "auto":
            head = "int8" if self.static else "float"
        self.head = (Int8Head(self.cfg, self.model.weights, threads, self.pool) if head == "int8"
                     else FloatHead(self.cfg, self.model.weights))

    @classmethod
    def of(cls, runtime: Runtime) -> "DecodeStep":
        step = cls._shared.get(runtime)
        if step is None:
            step = cls._shared[runtime] = cls(runtime)
        return step

    def padded_size(self, n: int) -> int:
        if not self.static:
            return n
        return next((c for c in TREE_SIZES if c >= n), n)

    def backend(self, n: int) -> LayerBackend:
        """The layer backend for a chunk of n rows (padded up to a prepared size on a static lane)."""
        if not self.static:
            return self.runtime.backend
        c = self.padded_size(n)
        b = self._backends.get(c)
        if b is None:
            b = self.runtime.backend.at_chunk(c, self.threads)
            self._backends[c] = b
        return b

    def measure(self, cache: KVCache, sizes: Sequence[int] = TREE_SIZES) -> dict[int, float]:
        """Time one step of each chunk size not measured yet (rows past cache.length: scratch, unchanged length)."""
        for c in sizes:
            if c not in self.costs:
                tree = TokenTree.chain([self.cfg.bos_token_id or 0] * c)
                for _ in range(2):  # warm-up (first-run allocations)
                    self.forward(cache, tree)
                times = []
                for _ in range(5):  # the least of five: one run on a shared machine can be a multiple
                    t0 = time.perf_counter()
                    self.forward(cache, tree)
                    times.append((time.perf_counter() - t0) * 1e3)
                self.costs[c] = min(times)
        return self.costs

    def forward(self, cache: KVCache, tree: TokenTree, *, slot: int | None = None, layers: int | None = None,
                rows: Sequence[int] | None = None) -> torch.Tensor:
        """Logits [len(rows), vocab] of the tree's rows (default all) after `layers` layers (default all).

        K/V go to cache rows slot..slot+n-1 (default slot = cache.length); the tree's root is at
        position `slot` (its depth 0). `cache.length` is not changed.
        """
        if not self.static:
            return self._forward(cache, tree, slot, layers, rows)
        with torch_threads(self.threads):
            return self._forward(cache, tree, slot, layers, rows)

    @torch.inference_mode()
    def _forward(self, cache: KVCache, tree: TokenTree, slot: int | None, layers: int | None,
                 rows: Sequence[int] | None) -> torch.Tensor:
        n = len(tree)
        slot = cache.length if slot is None else slot
        cache.reserve(slot + n - cache.length)
        c = self.padded_size(n)
        if self.static:  # the graphs of this size bound once (`bound.BoundStep`)
            bound = self._bound.get(c)
            if bound is None:
                bound = self._bound[c] = BoundStep(self.backend(c), self.runtime.rope, c, self.pool)
            try:
                h = bound.forward(cache, tree, slot, layers)
                return self._logits(h, n, rows)
            finally:
                if self.pool is not None:
                    self.pool.end()
        else:
            backend = self.backend(n)
            ids = torch.tensor(tree.tokens + [tree.tokens[0]] * (c - n), dtype=torch.long)
            h = ref.embed(self.model.weights, ids)
            positions = torch.cat([tree.positions(slot), torch.full((c - n,), slot, dtype=torch.long)])
            mask = None if tree.is_chain() else tree.mask()
            rope = self.runtime.rope
            for layer in range(self.cfg.n_layers if layers is None else layers):
                q, k, v = backend.qkv(layer, h)
                kc, vc = cache.layer(layer)
                a = ref.attention(self.cfg, q, k, v, rope, kc, vc, slot, n, positions, mask, row_attention,
                                  layer=layer, lw=self.model.weights.layers[layer])
                h = backend.o_ffn(layer, a, h)
        return self._logits(h, n, rows)

    def _logits(self, h: torch.Tensor, n: int, rows: Sequence[int] | None) -> torch.Tensor:
        sel = h[:n] if rows is None else h[list(rows)]
        if sel.shape[0] == 0:  # K/V only (a draft model catching up)
            return torch.empty(0, self.cfg.vocab)
        return self.head(sel)
