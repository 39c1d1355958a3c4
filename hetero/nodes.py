"""The nodes of a prefill DAG as a backend states them (`model.LayerBackend`): its kinds, and the functions that run
them on one prefill in flight.

A backend names the kinds it runs (`LayerBackend.node_kinds`: name → `NodeKind`) and, once per prompt, binds them to
the prefill's state (`LayerBackend.bind(job)` → `BoundNodes`): `runs[kind](i, layer)` runs the node of chunk i and
decoder layer `layer`. The bind is where a backend prepares per-prompt state (addresses checked once, say), so that a
node is one dict lookup (done once per node when the runtime starts the plan) and one call. The DAG (`dag.prefill_dag`)
and the runtime name no kind: they take the kinds, and which of them read earlier chunks' K/V, from here.

The generic layer of three kinds (mllm-NPU §3.2) is defined here once, for every backend with `qkv` and `o_ffn`
methods: `qkv` and `o_ffn` on the backend, `attn` on the runtime's attention (`attention.ChunkAttention`, the CPU
lane), which writes the chunk's K/V into the cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from hetero.errors import ConfigError

if TYPE_CHECKING:
    from hetero.chunking import Chunk
    from hetero.kv_cache import KVCache

NodeRun = Callable[[int, int], None]  # run(i, layer): the node of chunk i, decoder layer `layer`, of the bound job


@dataclass(frozen=True, slots=True)
class NodeKind:
    """One kind of DAG node: a part of a decoder layer that runs as one unit on one lane."""

    name: str
    # it reads the K/V that its layer's node of every earlier chunk wrote (attention): the DAG runs chunk i - 1's
    # node of this kind before chunk i's (`dag.prefill_dag`)
    reads_kv: bool = False


QKV = NodeKind("qkv")  # RMSNorm → q|k|v (static: the NPU lane)
ATTN = NodeKind("attn", reads_kv=True)  # RoPE, the chunk's K/V into the cache, attention over it (dynamic: the CPU)
O_FFN = NodeKind("o_ffn")  # o → residual → RMSNorm → FFN → residual (static)
KINDS: Mapping[str, NodeKind] = {k.name: k for k in (QKV, ATTN, O_FFN)}  # the generic layer's, by name
SUBGRAPH_KINDS = tuple(KINDS)  # one decoder layer, in execution order (mllm-NPU §3.2)
DEFAULT_PLACEMENT = ((QKV.name, "npu"), (ATTN.name, "cpu"), (O_FFN.name, "npu"))  # (kind, lane) of one layer


def reads_kv(placement: Sequence[Sequence[str]], kinds: Mapping[str, NodeKind] = KINDS) -> frozenset[str]:
    """The kinds of `placement` ((kind, lane) of one layer) that read earlier chunks' K/V, as `kinds` define them;
    ConfigError for a kind that `kinds` does not define."""
    unknown = [k for k, _ in placement if k not in kinds]
    if unknown:
        raise ConfigError(f"the placement names kinds {unknown} that are not among {sorted(kinds)}")
    return frozenset(k for k, _ in placement if kinds[k].reads_kv)


class ChunkRows(Protocol):
    """A prefill's per-chunk buffers (`runtime.ChunkBuffers`): per chunk i its two residual buffers h[i], its packed
    q|k|v rows qkv[i] and its attention rows attn[i], float32, C-contiguous, each at least the chunk's rows long."""

    h: list[tuple[np.ndarray, np.ndarray]]
    qkv: list[np.ndarray]
    attn: list[np.ndarray]


class CacheAttention(Protocol):
    """The runtime's attention of a chunk's rows over the cache (`attention.ChunkAttention`) and its RoPE tables."""

    cos: np.ndarray  # [positions, rotary dims / 2]: row p is position p
    sin: np.ndarray

    def __call__(self, qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int, out: np.ndarray,
                 layer: int | None = None, base: int = 0) -> np.ndarray:
        """RoPE, the rows' K/V into one layer's cache and the attention into out (`ChunkAttention.__call__`)."""
        ...


class Job(Protocol):
    """What a node reads and writes of the prefill in flight (`runtime.PrefillJob`)."""

    chunks: tuple[Chunk, ...]
    start: int  # positions cached before this prefill: chunk 0 starts there
    kinds: tuple[str, ...]  # the kinds its DAG runs
    cache: KVCache  # its length not yet advanced
    bufs: ChunkRows
    h: list[np.ndarray]  # per chunk: its current residual stream [rows, hidden] (a view of one of bufs.h[i])
    attn: list[np.ndarray | None]  # per chunk: its attention output [rows, q_dim], once an `attn` node wrote it
    attention: CacheAttention  # the runtime's attention over the cache, and its RoPE tables

    def spare_h(self, i: int) -> np.ndarray:
        """Chunk i's residual buffer [rows, hidden] that does not hold its current stream."""
        ...


class BoundNodes(Protocol):
    """A backend's nodes bound to one prefill (`LayerBackend.bind`)."""

    runs: Mapping[str, NodeRun]  # kind → run(i, layer), for every kind the job's DAG runs

    def check(self) -> None:
        """Before the commit: ConfigError where what the nodes relied on no longer holds."""
        ...


class LayerNodes:
    """The generic layer's kinds (`KINDS`) of a backend with `qkv` / `o_ffn` (`model.LayerBackend`), bound to a job."""

    __slots__ = ("backend", "job")

    def __init__(self, backend: object, job: Job):
        # the job owns its nodes (`runtime.PrefillJob.nodes`); they hold it weakly, so that nothing of a prefill is in
        # a reference cycle: its job, cache and buffers go when it ends, not when the garbage collector next runs
        # (a cycle kept a 2,048-token prompt's K/V, 90 MB, alive across the next prompts)
        self.backend, self.job = backend, weakref.proxy(job)

    @property
    def runs(self) -> dict[str, NodeRun]:
        """kind → run(i, layer) (made per call: bound methods kept on the nodes would be a cycle)."""
        return {QKV.name: self.qkv, ATTN.name: self.attn, O_FFN.name: self.o_ffn}

    def check(self) -> None:
        pass

    def qkv(self, i: int, layer: int) -> None:
        job = self.job
        self.backend.qkv(layer, job.h[i], out=job.bufs.qkv[i][: job.chunks[i].rows])  # packed q|k|v rows

    def attn(self, i: int, layer: int) -> None:
        # a windowed layer's rows hold its window from `base` on (`KVCache.place`); a layer's chunks run in order
        job = self.job
        c, cache, bufs = job.chunks[i], job.cache, job.bufs
        base = cache.place(layer, c.start, c.n_valid)
        k_cache, v_cache = cache.layer(layer)
        job.attention(bufs.qkv[i][: c.n_valid], k_cache, v_cache, c.start, bufs.attn[i][: c.n_valid], layer, base=base)
        job.attn[i] = bufs.attn[i][: c.rows]

    def o_ffn(self, i: int, layer: int) -> None:
        job = self.job
        job.h[i] = self.backend.o_ffn(layer, job.attn[i], job.h[i], out=job.spare_h(i))

