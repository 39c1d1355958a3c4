"""The memory-bounded chunk KV store: blocks of K/V in tiers under a global RAM budget (LLMS §3, Pensieve §4).

Tiers, top to bottom: float in RAM → compressed in RAM (INT8/INT4 by measured tolerance, LLMS §3.2) →
on disk (written ahead of time, LLMS §3.4) → dropped (recomputed from the kept token ids). When the RAM
bytes exceed `budget × (1 - reserve)` after a call, victims move one tier down, in LCTRU order (LLMS
§3.4: the least-compressed level first), and within a level by Pensieve's order (§4.3: the longest
idle first, the trailing blocks of a conversation first). Blocks pinned by a running request never move.
Every decision is counted in `stats()`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetero.errors import ConfigError
from hetero.kv_cache import KVCache
from hetero.serve.disk import DiskTier, compressed_payload, float_payload
from hetero.serve.index import Match, Node, PrefixIndex
from hetero.serve.quant import compress

_LEVEL_ORDER = {"ram": 0, "int8": 1, "int4": 2}


@dataclass(frozen=True, slots=True)
class StoreConfig:
    block: int = 16  # tokens per block (LLMS's chunk size)
    budget_bytes: int | None = None  # RAM for kept K/V (float + compressed); None = unbounded
    reserve: float = 0.1  # ahead of time, keep this fraction of the budget free after each call
    compress: str = "auto"  # "auto": INT8/INT4 by tolerance before swapping; "off": lossless tiers only
    tolerance: float = 0.1  # attention-output relative error allowed for the INT4 level
    disk: bool = True  # swap to disk (else drop and recompute)
    disk_budget_bytes: int | None = None  # None = unbounded
    kv_dir: Path | None = None  # parent of the private swap directory (default: the system temp dir)
    restore: str = "auto"  # "auto": per-block cheaper of swap-in / recompute, pipelined; "swap"; "recompute"
    reuse: bool = True  # False: never match a cached prefix (the stateless baseline that re-prefills everything)
    # True: a reply does not depend on what the cache holds (`exact_match`); False: every cached token is reused,
    # replies' rows and compressed blocks too (fewer tokens prefilled; replies may differ from a cold run's)
    exact: bool = True

    def __post_init__(self) -> None:
        if self.block <= 0:
            raise ConfigError(f"block must be > 0 tokens, got {self.block}")
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ConfigError(f"kv budget must be >= 0 bytes, got {self.budget_bytes}")
        if not 0 <= self.reserve < 1:
            raise ConfigError(f"reserve must be in [0, 1), got {self.reserve}")
        if self.compress not in ("auto", "off"):
            raise ConfigError(f"compress must be 'auto' or 'off', got {self.compress!r}")
        if self.restore not in ("auto", "swap", "recompute"):
            raise ConfigError(f"restore must be 'auto', 'swap' or 'recompute', got {self.restore!r}")


# Exact reuse. A runtime whose prefill gives the same K/V and logits however a prompt is cut
# (`cut_invariant`: every method on the CPU, tests/test_cut_invariance.py) reuses any cached prompt token exactly.
# One that does not say so (an NPU's kernels, unmeasured) is prefilled by the service in segments of SEGMENT tokens
# at multiples of SEGMENT (`segment_cuts`), so a whole segment's rows are a function of the tokens up to its end,
# whatever was cached, and a request reuses only such rows. Either way (`StoreConfig.exact`) a request reuses no
# compressed block (`exact_match`) and commits only its prompt's rows (`exact_end`): the decoded reply's rows are a
# decode step's math, not a prefill's, and the next turn prefills them again.
SEGMENT = 512


def cut_invariant(runtime: object) -> bool:
    """Whether a runtime's prefill gives the same K/V and logits bit for bit however a prompt is cut: its backend
    and its CPU lane's attention say so (every backend on the CPU, and the attention where ONNX Runtime's kernel
    runs it; tests/test_cut_invariance.py)."""
    parts = (getattr(runtime, "backend", None), getattr(runtime, "attention", None))
    return all(bool(getattr(p, "cut_invariant", False)) for p in parts)


def exact_end(n_prompt: int, segment: int | None) -> int:
    """The rows of a prompt of n_prompt tokens that a later request may reuse exactly: its whole segments (all of
    them where there are no segments)."""
    return n_prompt if segment is None else n_prompt // segment * segment


def segment_cuts(start: int, n_new: int, segment: int | None) -> list[int]:
    """Ends (offsets into the n_new tokens after position start) of the prefill's segments: one at each multiple of
    `segment` (none where it is None), and at n_new."""
    return ([] if segment is None else list(range(segment - start % segment, n_new, segment))) + [n_new]


def exact_match(match: Match, segment: int | None) -> Match:
    """The part of `match` a cold prefill reproduces bit for bit: up to the first compressed block (`Node.lossy`);
    with segments, also up to the first dropped one (recomputing it would cut other chunks), whole segments only."""
    end = 0
    for node, used in match.nodes():
        if node.lossy or (segment is not None and node.tier == "dropped"):
            break
        end = node.start + used
    end = exact_end(end, segment)
    path = tuple(n for n in match.path if n.end <= end)
    partial = next((n for n, _ in match.nodes() if n.start < end < n.end), None)
    return Match(path, partial, end - partial.start if partial is not None else 0)


class ChunkStore:
    """Owns the prefix index and every block's payload. Mutated by one thread (the engine's)."""

    def __init__(self, config: StoreConfig):
        self.config = config
        self.index = PrefixIndex(config.block)
        self.disk = DiskTier(config.kv_dir) if config.disk else None
        self.counts: Counter[str] = Counter()
        self.errors: list[float] = []  # measured attention-output error of each compressed block
        self._lock = threading.Lock()  # guards node.disk / disk bytes against the writer thread
        self.disk_bytes = 0
        self.ram = 0  # bytes of K/V held in RAM (float + compressed)

    # --- lookup and pins -------------------------------------------------------------------------
    def match(self, ids: list[int], limit: int | None = None) -> Match:
        return self.index.match(ids, limit) if self.config.reuse else Match((), None, 0)

    @staticmethod
    def pin(nodes: list[Node] | tuple[Node, ...], delta: int = 1) -> None:
        for n in nodes:
            n.pins += delta

    @staticmethod
    def hold(path: list[Node] | tuple[Node, ...], delta: int = 1) -> None:
        """Add (or with -1 remove) a context's reference to every node of its path."""
        for n in path:
            n.refs += delta

    # --- commit: the request's cache → blocks --------------------------------------------------
    def commit(self, ids: list[int], cache: KVCache, end: int | None = None) -> list[Node]:
        """Blocks for positions [0, end) (default cache.length) of `ids`: existing ones are kept, new ones copied in."""
        n, b = min(cache.length, cache.length if end is None else end), self.config.block
        now, node, path = time.monotonic(), self.index.root, []
        for a in range(0, n, b):
            blk = tuple(ids[a : min(a + b, n)])
            child = self.index.find_child(node, blk)
            if child is None:
                child = self.index.add(node, blk)
                for s in self.index.subsumed(child):
                    self.delete(s)
                self._set_float(child, *cache.read_span(a, a + len(blk)))
                self.counts["blocks_created"] += 1
            elif child.tier in ("disk", "dropped"):  # swapped back in by this request: keep it hot
                self._set_float(child, *cache.read_span(a, a + len(blk)))
                self.counts["blocks_readmitted"] += 1
            child.last_used = now
            path.append(child)
            node = child
        return path

    def _set_float(self, node: Node, k: np.ndarray, v: np.ndarray) -> None:
        self.ram -= node.ram_bytes()
        node.k, node.v, node.qk, node.qv = k, v, None, None
        self.ram += node.ram_bytes()
        if self.disk is not None and self.config.budget_bytes is not None and node.disk is None \
                and node.writing is None:  # without a budget nothing is ever demoted: no copy to write
            self._write_ahead(node)

    def _write_ahead(self, node: Node) -> None:
        """Ahead-of-time swap-out (LLMS §3.4): a clean disk copy, so a later reclaim only drops RAM."""
        fut = self.disk.submit_write(node.uid, float_payload(node.k, node.v))
        node.writing = fut

        def done(f, node=node) -> None:
            if f.exception() is not None:
                return
            path, size, _ = f.result()
            with self._lock:
                if node.writing is f:
                    node.disk, node.writing = path, None
                    self.disk_bytes += size
                    self.counts["aot_writes"] += 1
                    self.counts["aot_bytes"] += size
                else:  # deleted meanwhile
                    path.unlink(missing_ok=True)

        fut.add_done_callback(done)

    # --- eviction ------------------------------------------------------------------------------
    def rebalance(self) -> None:
        """Move victims down until RAM ≤ budget·(1 - reserve), then trim the disk tier to its budget."""
        budget = self.config.budget_bytes
        if budget is not None:
            target = int(budget * (1 - self.config.reserve))
            while self.ram > target:
                victims = self._lctru([n for n in self.index.walk() if n.pins == 0 and n.ram_bytes()])
                if not victims:
                    self.counts["budget_overruns"] += 1
                    break
                for v in victims:
                    if self.ram <= target:
                        break
                    self._demote(v)
        limit = self.config.disk_budget_bytes
        if self.disk is not None and limit is not None and self.disk_bytes > limit:
            # first the ahead-of-time copies of blocks still in RAM (nothing is lost), then swapped blocks
            # (dropped: recomputed from their ids when next needed)
            spare = [n for n in self.index.walk() if n.pins == 0 and n.disk is not None and n.tier != "disk"]
            for v in self._lctru(spare) + self._lctru([n for n in self.index.walk()
                                                       if n.pins == 0 and n.tier == "disk"]):
                if self.disk_bytes <= limit:
                    break
                if v.tier == "disk":
                    self._drop(v)
                else:
                    self._forget_disk(v)
                    self.counts["disk_copies_forgotten"] += 1
        self._prune()

    def flush(self) -> int:
        """Drop the K/V of every block no running request pins (RAM and disk); returns how many. Blocks that
        contexts hold keep their ids (recomputed when next used); the others are forgotten."""
        n = 0
        for node in list(self.index.walk()):
            if node.pins == 0 and node.tier != "dropped":
                self._drop(node)
                n += 1
        self._prune()
        self.counts["flushes"] += 1
        return n

    def _lctru(self, nodes: list[Node]) -> list[Node]:
        """LLMS's LCTRU queue: least-compressed level first; then Pensieve: longest idle, trailing first."""
        def level(n: Node) -> int:
            return _LEVEL_ORDER["ram"] if n.k is not None else _LEVEL_ORDER.get(n.qk.level if n.qk else "", 3)

        return sorted(nodes, key=lambda n: (level(n), n.last_used, -n.depth))

    def _demote(self, node: Node) -> None:
        if node.k is not None and self.config.compress == "auto":
            qk, qv, err = compress(node.k, node.v, self.config.tolerance)
            before = node.ram_bytes()
            self.ram -= before
            node.k = node.v = None
            node.qk, node.qv, node.lossy = qk, qv, True
            self.ram += node.ram_bytes()
            self.errors.append(err)
            self.counts[f"compressed_{qk.level}"] += 1
            self.counts["compressed_bytes_before"] += before
            self.counts["compressed_bytes_after"] += node.ram_bytes()
        elif self.disk is not None:
            self._ensure_disk(node)
            self.ram -= node.ram_bytes()
            node.k = node.v = node.qk = node.qv = None
            self.counts["swap_out_blocks"] += 1
        else:
            self._drop(node)

    def _ensure_disk(self, node: Node) -> None:
        if node.writing is not None:
            node.writing.result()  # the ahead-of-time write is still running: wait for it
            self.counts["swap_out_waited"] += 1
        if node.disk is None:  # no clean copy (e.g. the write failed): write synchronously
            payload = float_payload(node.k, node.v) if node.k is not None else compressed_payload(node.qk, node.qv)
            path, size, _ = self.disk.write(node.uid, payload)
            with self._lock:
                node.disk = path
                self.disk_bytes += size
            self.counts["swap_out_sync_writes"] += 1

    def _drop(self, node: Node) -> None:
        self.ram -= node.ram_bytes()
        node.k = node.v = node.qk = node.qv = None
        self._forget_disk(node)
        self.counts["dropped_blocks"] += 1

    def _forget_disk(self, node: Node) -> None:
        with self._lock:
            node.writing = None  # a write in flight deletes its file when it completes
            if node.disk is not None:
                size = node.disk.stat().st_size if node.disk.exists() else 0
                node.disk.unlink(missing_ok=True)
                self.disk_bytes -= size
                node.disk = None

    def _prune(self) -> None:
        """Forget dropped leaves nobody holds: nothing would be saved by keeping their ids."""
        for n in self.index.walk():
            while n.parent is not None and n.tier == "dropped" and not n.children and n.refs == 0 and n.pins == 0:
                parent = n.parent
                self.delete(n)
                n = parent

    def delete(self, node: Node) -> None:
        self.ram -= node.ram_bytes()
        node.k = node.v = node.qk = node.qv = None
        self._forget_disk(node)
        self.index.remove(node)

    def release(self, path: list[Node]) -> None:
        """A context let go of `path`: unreferenced nodes stay as kept prefixes until evicted, except a
        partial tail that a longer sibling now covers (the same K/V, kept once)."""
        self.hold(path, -1)
        for n in path:
            if n.refs == 0 and n.pins == 0 and not n.children and len(n.ids) < self.config.block and any(
                    n in self.index.subsumed(s) for s in n.parent.children.get(n.ids[0], ()) if s is not n):
                self.delete(n)

    # --- stats ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        tiers: Counter[str] = Counter()
        tier_bytes: Counter[str] = Counter()
        for n in self.index.walk():
            tiers[n.tier] += 1
            tier_bytes[n.tier] += n.ram_bytes()
        before, after = self.counts["compressed_bytes_before"], self.counts["compressed_bytes_after"]
        return {
            "budget_bytes": self.config.budget_bytes,
            "bytes": {"ram_float": tier_bytes["ram"], "ram_compressed": tier_bytes["compressed"],
                      "disk": self.disk_bytes},
            "blocks": dict(tiers),
            "counts": dict(self.counts),
            "compression_ratio": round(before / after, 3) if after else None,
            "compression_error_mean": round(sum(self.errors) / len(self.errors), 5) if self.errors else None,
        }

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
