"""Restore a cached prefix into a request's KV cache: the swapping-recompute pipeline (LLMS §3.3).

Blocks in RAM are copied, compressed ones dequantised, dropped ones recomputed from their token ids
(exactly: a chunked prefill at their absolute positions over the K/V restored before them). Blocks on
disk are either read back by the IO thread or recomputed, whichever the cost model says finishes the
restore sooner: recomputing the first n disk blocks while the IO thread reads the rest overlaps the two,
and n minimises max(T_recompute, T_io) (LLMS Eq. 4, solved by a scan since T_re depends on the count).
The pipeline is per block, not per layer as in LLMS (a block file holds all layers).

A restore yields to the engine (which then steps the other requests, each a prefill chunk or a decoded
token) after every recomputation and otherwise once `SLICE_S` of copying has passed: a yield after every
16-token block copied from RAM would make a restore's wall time the block count times the other requests'
steps, most of a second for a 1,000-token context under 4 clients instead of a few milliseconds.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field

from hetero.kv_cache import KVCache
from hetero.runtime import Runtime
from hetero.serve.disk import payload_kv
from hetero.serve.index import Match
from hetero.serve.quant import dequantize
from hetero.serve.store import ChunkStore

SLICE_S = 0.02  # copying work between two yields: well under one prefill chunk's step


@dataclass(slots=True)
class CostModel:
    """Measured restore costs, refined after every restore (exponential moving averages)."""

    recompute_ms_per_token: float = 2.0  # first guesses until a measurement exists
    io_ms_per_mb: float = 2.0
    alpha: float = 0.3

    def observe_recompute(self, ms: float, tokens: int) -> None:
        if tokens:
            self.recompute_ms_per_token += self.alpha * (ms / tokens - self.recompute_ms_per_token)

    def observe_io(self, ms: float, nbytes: int) -> None:
        if nbytes:
            self.io_ms_per_mb += self.alpha * (ms / (nbytes / 2**20) - self.io_ms_per_mb)

    def plan(self, disk: list[tuple[int, int]], dropped_tokens: int) -> int:
        """How many of the leading disk blocks (tokens, bytes) to recompute instead of reading."""
        best_n, best_t = 0, float("inf")
        re_tok, io_bytes = dropped_tokens, sum(b for _, b in disk)
        for n in range(len(disk) + 1):
            t = max(self.recompute_ms_per_token * re_tok, self.io_ms_per_mb * io_bytes / 2**20)
            if t < best_t:
                best_n, best_t = n, t
            if n < len(disk):
                re_tok += disk[n][0]
                io_bytes -= disk[n][1]
        return best_n


@dataclass(slots=True)
class RestoreReport:
    tokens: Counter = field(default_factory=Counter)  # restore path -> tokens: ram, compressed, disk, recompute
    ms: float = 0.0
    io_ms: float = 0.0
    recompute_ms: float = 0.0


def restore(store: ChunkStore, runtime: Runtime, match: Match, cache: KVCache, cost: CostModel,
            mode: str = "auto") -> Generator[None, None, RestoreReport]:
    """Fill positions [0, match.n_tokens) of an empty `cache`; yields after each recomputation and every
    `SLICE_S` of copies (the engine interleaves other requests there)."""
    t0 = t_yield = time.perf_counter()
    report = RestoreReport()
    items = match.nodes()
    kinds = [n.tier for n, _ in items]
    disk = [i for i, k in enumerate(kinds) if k == "disk"]
    if mode == "recompute":
        n_re = len(disk)
    elif mode == "swap":
        n_re = 0
    else:
        dropped = sum(u for (n, u), k in zip(items, kinds) if k == "dropped")
        n_re = cost.plan([(items[i][1], items[i][0].ram_bytes() or cache.nbytes(items[i][1]))
                          for i in disk], dropped)
    for i in disk[:n_re]:
        kinds[i] = "dropped"
    reads = {i: store.disk.submit_read(items[i][0].disk) for i in disk[n_re:]}
    pos, i = 0, 0
    while i < len(items):
        if kinds[i] == "dropped":
            ids: list[int] = []
            while i < len(items) and kinds[i] == "dropped":
                node, used = items[i]
                ids.extend(node.ids[:used])
                i += 1
            t1 = time.perf_counter()
            steps = runtime.prefill_steps(ids, cache=cache)  # from cache.length = pos to pos + len(ids)
            while True:
                try:
                    next(steps)
                except StopIteration:
                    break
                yield
            ms = (time.perf_counter() - t1) * 1e3
            cost.observe_recompute(ms, len(ids))
            report.recompute_ms += ms
            report.tokens["recompute"] += len(ids)
            store.counts["recomputed_blocks"] += 1
            store.counts["recomputed_tokens"] += len(ids)
            pos += len(ids)
            yield
            t_yield = time.perf_counter()
            continue
        node, used = items[i]
        if kinds[i] == "ram":
            k, v = node.k, node.v
        elif kinds[i] == "compressed":
            k, v = dequantize(node.qk), dequantize(node.qv)
        else:
            payload, nbytes, io_ms = reads.pop(i).result()
            k, v = payload_kv(payload)
            cost.observe_io(io_ms, nbytes)
            report.io_ms += io_ms
            store.counts["swap_in_blocks"] += 1
            store.counts["swap_in_bytes"] += nbytes
        cache.write_span(pos, k[:, :, :used], v[:, :, :used])
        report.tokens[kinds[i]] += used
        pos += used
        i += 1
        if time.perf_counter() - t_yield > SLICE_S:
            yield
            t_yield = time.perf_counter()
    report.ms = (time.perf_counter() - t0) * 1e3
    return report
