"""`Runtime.prefill`: a prompt → chunks → subgraphs → KV cache + last logits, in three steps (vLLM style).

`plan` validates the prompt and freezes what will run (chunks + the compiled DAG of Eq. 2-3);
`execute` hands every subgraph G[i][j] to the runtime's executor (`SerialExecutor` in program order,
or `hetero.sched.executor.OutOfOrderExecutor`, mllm-NPU §3.4), which runs it on per-chunk buffers
allocated once per runtime; `commit` advances the KV cache and returns a frozen `PrefillResult`.

`prefill_steps` runs the same one plan in slices: the executor's `PlanRun` stops dispatching when a
slice's time is up, lets the running subgraphs finish (a wave boundary: nothing in flight) and resumes at
the next `next()`. A service interleaves other requests there without cutting a prompt into one-chunk
plans (which would run every chunk as a chain and lose the lanes' overlap). Each plan in flight holds its
own chunk buffers (a pool: one set per plan suspended at once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np

from hetero import buffers
from hetero.attention import ChunkAttention
from hetero.chunking import Chunk, ChunkRule, check_chunk, padded_ids, token_ids
from hetero.dag import CompiledDag, prefill_dag
from hetero.errors import ConfigError
from hetero.hostplan import DecodePlacement, HostPlan, PrefillLayout
from hetero.kv_cache import KVCache, check_cache
from hetero.loader import Model
from hetero.nodes import reads_kv
from hetero.rope import RopeTable
from hetero.schedule import Schedule
from hetero.tensorfile import drop_pages, read_only
from hetero.threads import ExecutionPlan, torch_threads

if TYPE_CHECKING:
    from hetero.model import LayerBackend
    from hetero.nodes import BoundNodes

class Closeable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Closeable)
NodeFn = Callable[[int], None]  # runs the subgraph of DAG node v (see CompiledDag.node_info)


class PlanRun(Protocol):
    """One DAG's execution, advanced in slices; between two `step`s no subgraph of it runs."""

    def step(self, budget_s: float | None, contended: Callable[[], bool] | None = None) -> bool:
        """Run nodes until all are done (True) or `budget_s` has passed (None: no limit) and `contended()`
        says someone waits (asked once a budget; None: always stop); then let the running ones finish and
        return (False: more to run)."""
        ...

    def schedule(self) -> Schedule:
        """What ran when, once `step` returned True (times from the first step's start, gaps included)."""
        ...

    @property
    def n_done(self) -> int:
        """Subgraphs finished so far."""
        ...


class PrefillExecutor(Protocol):
    """Runs the nodes of a prefill DAG: each exactly once, after its predecessors (Eq. 2-3)."""

    placement: tuple[tuple[str, str], ...]  # (kind, lane) of one layer's subgraphs
    chunk: int | None  # the chunk length C its costs were made for (`Runtime` checks it is the plan's); None: any
    # k: chunk i's first node runs after chunk i - k's last, so that at most k chunks are in flight and chunk i may
    # use chunk i - k's buffers (`ChunkBuffers.views`); None: any order (a buffer set per chunk)
    chunks_in_flight: int | None

    def compile(self, n_chunks: int, reads_kv: frozenset[str]) -> CompiledDag:
        """The DAG of a prompt of `n_chunks` chunks, whose kinds `reads_kv` read the K/V of earlier chunks (the
        backend's `NodeKind.reads_kv`; cached per count)."""
        ...

    def start(self, dag: CompiledDag, run: NodeFn) -> PlanRun:
        """A run of `dag` that calls run(v) for every node as it is stepped."""
        ...

    def execute(self, dag: CompiledDag, run: NodeFn) -> Schedule:
        """Call run(v) for every node; return when all are done, with what ran when."""
        ...

    def close(self) -> None: ...


class SerialRun:
    """Nodes in id order on the calling thread, `step` by `step`."""

    def __init__(self, name: str, dag: CompiledDag, run: NodeFn):
        self.name, self.dag, self.run, self.next = name, dag, run, 0
        self.start_us, self.end_us = [0.0] * dag.n_nodes, [0.0] * dag.n_nodes
        self.t_origin: float | None = None

    def step(self, budget_s: float | None, contended: Callable[[], bool] | None = None) -> bool:
        clock, n = time.perf_counter, self.dag.n_nodes
        if self.t_origin is None:
            self.t_origin = clock()
        deadline = None if budget_s is None else clock() + budget_s
        while self.next < n:
            v, t0 = self.next, clock()
            self.run(v)
            t1 = clock()
            self.start_us[v], self.end_us[v] = (t0 - self.t_origin) * 1e6, (t1 - self.t_origin) * 1e6
            self.next += 1
            if deadline is not None and t1 >= deadline:
                if contended is None or contended():
                    break
                deadline = t1 + budget_s  # nobody waits: run on, without a pause
        return self.next == n

    @property
    def n_done(self) -> int:
        return self.next

    def schedule(self) -> Schedule:
        if self.next != self.dag.n_nodes:
            raise ConfigError(f"the plan ran {self.next} of {self.dag.n_nodes} subgraphs: no schedule yet")
        return Schedule.of_run(self.name, self.dag, self.start_us, self.end_us, decision_us=0.0)


class SerialExecutor:
    """Every node in id order (program order) on the calling thread: the in-order prefill."""

    chunk = None  # its DAGs do not depend on the chunk length
    chunks_in_flight = 1  # ids are chunk-major: a chunk's nodes all run before the next chunk's

    def __init__(self, n_layers: int, placement: tuple[tuple[str, str], ...]):
        self.n_layers, self.placement = n_layers, tuple(placement)
        self._dags: dict[tuple[int, frozenset[str]], CompiledDag] = {}

    def compile(self, n_chunks: int, reads_kv: frozenset[str]) -> CompiledDag:
        dag = self._dags.get((n_chunks, reads_kv))
        if dag is None:
            dag = self._dags[n_chunks, reads_kv] = prefill_dag(n_chunks, self.placement, self.n_layers,
                                                               reads_kv=reads_kv)
        return dag

    def start(self, dag: CompiledDag, run: NodeFn) -> SerialRun:
        return SerialRun("serial", dag, run)

    def execute(self, dag: CompiledDag, run: NodeFn) -> Schedule:
        r = self.start(dag, run)
        r.step(None)
        return r.schedule()

    def close(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """What one prefill runs, fixed before the first subgraph does."""

    ids: np.ndarray  # [n] new token ids (int64), validated
    start: int  # P: positions already cached; chunk 0 starts there
    chunks: tuple[Chunk, ...]
    dag: CompiledDag  # node v runs dag.node_info(v) = (chunk i, layer, kind)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a prefill hands to a decoding engine."""

    cache: KVCache  # length = start + n_tokens
    logits: np.ndarray  # [vocab] float32, of the last real token
    n_tokens: int  # new tokens prefilled
    start: int  # P: cached positions before this prefill
    chunk_ms: tuple[float, ...]  # from the prefill's start until each chunk's last subgraph ended
    total_ms: float
    schedule: Schedule | None = None  # what ran when, on which lane

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / (self.total_ms / 1e3) if self.total_ms > 0 else float("inf")


class ChunkBuffers:
    """Per-chunk activations, allocated once per runtime (grown to the most chunks in flight a prompt needed), each of
    C rows or of a prompt's longest chunk where the runtime's chunk rule cuts longer ones (`ChunkRule.max_rows`).

    Set s holds h[s] = (a, b) [C, hidden], the residual stream ping-ponging between a and b (a backend
    reads one and writes the other), qkv[s] [C, q_dim + 2·kv_dim], of which q/k/v are views, and
    attn[s] [C, q_dim], the attention output (zeros at first: padded rows are never written). float32 numpy
    arrays, 64-byte aligned (`hetero.buffers`): the graphs bind them in place, and a torch backend sees them through
    `torch.from_numpy` views. Chunk i uses set i mod k where the executor runs at most k chunks at once
    (`PrefillExecutor.chunks_in_flight`): the buffers are sized by the chunk, not by the prompt.
    """

    def __init__(self, model: Model, rule: ChunkRule):
        self.cfg, self.rule = model.config, rule  # (the runtime's: C is read from it, never stored here)
        self.h: list[tuple[np.ndarray, np.ndarray]] = []
        self.qkv: list[np.ndarray] = []
        self.attn: list[np.ndarray] = []

    def views(self, chunks: tuple[Chunk, ...], in_flight: int | None) -> "ChunkViews":
        """Per chunk of a prefill its buffer set (set i mod `in_flight`; None: a set per chunk), every set of max(C,
        the longest chunk) rows (only as long as needed: a short prompt's first chunk is never 1.5·C); a ConfigError
        for a chunk longer than the rule allows."""
        sets = len(chunks) if in_flight is None else min(in_flight, len(chunks))
        self.ensure(sets, max(ch.rows for ch in chunks))
        pick = [i % sets for i in range(len(chunks))]
        return ChunkViews([self.h[s] for s in pick], [self.qkv[s] for s in pick], [self.attn[s] for s in pick])

    def ensure(self, sets: int, longest: int) -> None:
        """`sets` buffer sets of at least max(C, `longest`) rows."""
        cfg = self.cfg
        if longest > self.rule.max_rows:
            raise ConfigError(f"a chunk of {longest} rows exceeds the {self.rule.max_rows} rows the runtime's chunk "
                              f"rule allows")
        c = max(self.rule.chunk, longest)
        for i in range(sets):
            if i < len(self.h) and self.h[i][0].shape[0] >= c:
                continue
            h = (buffers.empty((c, cfg.hidden)), buffers.empty((c, cfg.hidden)))
            qkv, attn = buffers.empty((c, cfg.q_dim + 2 * cfg.kv_dim)), buffers.zeros((c, cfg.q_dim))
            if i == len(self.h):
                self.h.append(h)
                self.qkv.append(qkv)
                self.attn.append(attn)
            else:  # set i was shorter than this plan's longest chunk
                self.h[i], self.qkv[i], self.attn[i] = h, qkv, attn


@dataclass(frozen=True, slots=True)
class ChunkViews:
    """Per chunk of one prefill its buffer set of `ChunkBuffers` (`nodes.ChunkRows`: indexed by chunk)."""

    h: list[tuple[np.ndarray, np.ndarray]]
    qkv: list[np.ndarray]
    attn: list[np.ndarray]


class PrefillJob:
    """The state of one prefill in flight (`nodes.Job`): its chunks' residual streams and buffers, the cache, and the
    backend's nodes bound to it (`LayerBackend.bind`), which run each node of the DAG (`runs[kind](i, layer)`)."""

    def __init__(self, runtime: "Runtime", plan: PrefillPlan, cache: KVCache, buffers: ChunkBuffers | None = None):
        rt = runtime
        self.plan, self.cache = plan, cache
        self.chunks, self.start, self.kinds = plan.chunks, plan.start, plan.dag.kinds
        self.attention = rt.attention
        self.embedding, self.embed_scale = rt.embedding, rt.cfg.embed_scale
        self.bufs = (buffers or rt.buffers).views(plan.chunks, rt.executor.chunks_in_flight)
        # per chunk: its two residual buffers at its rows (the stream alternates between them layer by layer)
        self._pairs = [(self.bufs.h[c.index][0][: c.rows], self.bufs.h[c.index][1][: c.rows]) for c in plan.chunks]
        # per chunk: the current residual stream [C, hidden], its embedding rows once its first node starts (`embed`)
        self.h: list[np.ndarray] = [a for a, _ in self._pairs]
        self.attn: list[np.ndarray | None] = [None] * len(plan.chunks)
        self.nodes: BoundNodes = rt.backend.bind(self)

    def embed(self, i: int) -> None:
        """Chunk i's embedding rows into its first residual buffer, before its first node: not earlier, as its buffer
        set may serve an earlier chunk until then (`ChunkBuffers.views`). The embedding's pages go back at once."""
        c, h = self.chunks[i], self._pairs[i][0]
        np.take(self.embedding, padded_ids(self.plan.ids, c, self.plan.start), axis=0, out=h)
        if self.embed_scale != 1.0:  # as `model.embed`
            h *= np.float32(self.embed_scale)
        self.h[i] = h
        drop_pages(self.embedding)

    def check(self) -> None:
        """What the nodes relied on still holds (`BoundNodes.check`); before the commit."""
        self.nodes.check()

    def spare_h(self, i: int) -> np.ndarray:
        """Chunk i's residual buffer that does not hold its current stream (the two alternate layer by layer)."""
        a, b = self._pairs[i]
        return b if self.h[i].ctypes.data == a.ctypes.data else a


class Runtime:
    """Chunked prefill of one model: `backend` runs the static subgraphs (float reference by default),
    `executor` decides the order (in program order on the calling thread by default), `host_plan` (`hostplan.HostPlan`,
    resolved at the edge by `methods.make_runtime`) holds C and every decision of how it runs on this host; without
    one, the runtime's plan is what its caller gave (`HostPlan.given`): `chunk` (C, or a `ChunkRule`: a wavefront's
    chunks), `execution` (or every core on `attention_threads`), `decode`, `layout`.

    head: the LM head of the last token's final hidden rows, called as head(runtime, h [n, hidden]) → [n, vocab]
    (default: the float head, `float_head`)."""

    def __init__(self, model: Model, chunk: int | ChunkRule | None = None, backend: LayerBackend | None = None,
                 max_context: int | None = None, executor: PrefillExecutor | None = None,
                 attention_threads: int | None = None, decode: DecodePlacement | None = None,
                 execution: ExecutionPlan | None = None, layout: PrefillLayout | None = None,
                 head: Callable[["Runtime", np.ndarray], np.ndarray] | None = None, host_plan: HostPlan | None = None):
        self.model, self.cfg = model, model.config
        ctx = self.cfg.context_length
        if max_context is not None and not 0 < max_context <= ctx:
            raise ConfigError(f"max_context must be in [1, {ctx}], got {max_context}")
        self.max_context = max_context or ctx
        if backend is None:
            from hetero.torch_backends import FloatBackend

            backend = FloatBackend(self.cfg, model.weights)
        self.backend = backend  # takes the numpy buffers (a torch backend through views: `torch_backends`)
        if host_plan is None:
            rule = chunk if isinstance(chunk, ChunkRule) else ChunkRule(check_chunk(256 if chunk is None else chunk, ctx))
            host_plan = HostPlan.given(rule, execution or ExecutionPlan.for_host(attention_threads, overlapped=False),
                                       decode, layout, backend.name, executor)
        else:
            given = [n for n, v in (("decode", decode), ("execution", execution), ("layout", layout),
                                    ("attention_threads", attention_threads)) if v is not None]
            if given:
                raise ConfigError(f"the host plan holds {', '.join(given)}: give them in it, not beside it")
            if chunk is not None and chunk not in (host_plan.chunk, host_plan.chunks):
                raise ConfigError(f"chunk {chunk} disagrees with the host plan's C={host_plan.chunk}: give one")
        self.host_plan = host_plan
        check_chunk(self.chunk, ctx)
        if not backend.any_rows and backend.chunk != self.chunk:  # fixed-shape graphs take exactly their C rows
            raise ConfigError(f"the runtime's chunk length {self.chunk} differs from the {backend.chunk} rows its "
                              f"backend's graphs take: make both with the same chunk")
        self.executor = executor or SerialExecutor(self.cfg.n_layers, backend.default_placement)
        if self.executor.chunk not in (None, self.chunk):
            raise ConfigError(f"the runtime's chunk length {self.chunk} differs from the {self.executor.chunk} its "
                              f"executor's costs were made for: make both with the same chunk")
        self.placement = self.executor.placement
        # the placement's kinds as the backend defines them: which read earlier chunks' K/V (cross-chunk edges)
        self.reads_kv = reads_kv(self.placement, backend.node_kinds)
        # the last token's logits from its final hidden rows: the float head by default; an INT8 runtime's is the INT8
        # head its decode steps use (`decode.step.step_logits`: 28 instead of 113 MB to read)
        self.head = head or Runtime.float_head
        # the embedding rows chunks start from (numpy: a cached model's mapped file, `Model.arrays`)
        # (a mapped file is checked at its first use: here); through a read-only mapping of its own, whose pages go
        # back once a chunk's rows are copied (`PrefillJob.embed`): a 64 KB fault-around per row looked up kept
        # 23-48 MB of a 113 MB embedding resident after a 2,048-token prompt, for its 1.5 MB of rows
        self.embedding = read_only(model.arrays()["tok_emb"])
        self.rope = RopeTable(self.cfg, ctx + self.chunk)  # + chunk: padded rows of the last chunk
        # the `attn` subgraph of every chunk (the CPU lane): ORT's GroupQueryAttention over the cache, on the plan's
        # thread shares (`threads.ExecutionPlan`)
        rope, arrays = self.rope, model.arrays()
        self.attention = ChunkAttention(
            self.cfg, rope.cos, rope.sin, self.execution.threads,
            local=(rope.local_cos, rope.local_sin) if rope.local_cos is not None else None,
            qk_norms=[(arrays[f"layers.{i}.q_norm"], arrays[f"layers.{i}.k_norm"]) for i in range(self.cfg.n_layers)]
            if self.cfg.qk_norm else None,
            pool=self.execution.ort_pool)
        self.buffers = ChunkBuffers(model, host_plan.chunks)  # what a lone prefill uses (first in the pool)
        self._spare = [self.buffers]  # free buffer sets: a plan in flight holds one until it ends
        self._busy = threading.Lock()  # one slice of one prefill at a time (callers may be threads)
        self._owned: dict[str, Closeable] = {}

    @property
    def chunk(self) -> int:
        """The chunk length C: the host plan's (`ChunkRule.chunk`), its one place."""
        return self.host_plan.chunks.chunk

    @property
    def execution(self) -> ExecutionPlan:
        """How the runtime uses the host's cores (the host plan's thread shares)."""
        return self.host_plan.execution

    @property
    def decode(self) -> DecodePlacement | None:
        """Where decode steps run (the host plan's; None: on the backend's own engines, `decode.step.DecodeStep`)."""
        return self.host_plan.decode

    @property
    def layout(self) -> PrefillLayout | None:
        """How the plan laid the prefill out (`npu.placement`); None: float layers, or not asked."""
        return self.host_plan.layout

    def float_head(self, h: np.ndarray) -> np.ndarray:
        """The float LM head (`model.logits`) of hidden rows [n, hidden]."""
        import torch

        from hetero import model as ref

        with torch.inference_mode():
            return ref.logits(self.cfg, self.model.weights, torch.from_numpy(h)).numpy()

    def owned(self, name: str, make: Callable[[], C]) -> C:
        """The runtime's one `name` (its decode step), made by `make()` on first use and closed with the runtime:
        what a runtime holds (a helper thread, sessions) ends in `close()`, not in a process-wide cache."""
        obj = self._owned.get(name)
        if obj is None:
            obj = self._owned[name] = make()
        return obj  # type: ignore[return-value]

    def owned_bytes(self) -> dict[str, int]:
        """Bytes of what the runtime owns that counts its own (`nbytes`: its decode step's weights arena), by name:
        the memory reports set them beside the RSS (`bench/memory.py`)."""
        return {name: int(obj.nbytes) for name, obj in self._owned.items()
                if isinstance(getattr(obj, "nbytes", None), int)}

    def close(self) -> None:
        """Release what the runtime owns (its decode step's helper thread) and the executor (the lane workers of
        an out-of-order one)."""
        for obj in self._owned.values():
            obj.close()
        self._owned.clear()
        self.executor.close()

    def new_cache(self, capacity: int | None = None, full_history: bool = False) -> KVCache:
        """An empty cache (default: room for max_context); windowed layers keep only their window unless
        full_history (`KVCache`)."""
        return KVCache(self.cfg, capacity or self.max_context, full_history=full_history)

    def check_ids(self, ids: object, start: int = 0) -> np.ndarray:
        """Validate token ids at the edge (a list, numpy or torch integers): 1-D, non-empty, in the vocabulary,
        within the context; as an int64 numpy array."""
        t = token_ids(ids, self.cfg.vocab)
        if start + t.size > self.max_context:
            raise ConfigError(
                f"prompt of {t.size} tokens (+{start} cached) exceeds the context length {self.max_context}"
            )
        return t

    # ------------------------------------------------------------------ the three steps of a prefill
    def plan(self, ids: object, start: int = 0) -> PrefillPlan:
        """Validate `ids` (new tokens from position `start`) and fix the chunks and the DAG."""
        ids = self.check_ids(ids, start)
        chunks = tuple(self.host_plan.chunks.cut(ids.size, start, self.backend.any_rows))
        return PrefillPlan(ids, start, chunks, self.executor.compile(len(chunks), self.reads_kv))

    def start(self, plan: PrefillPlan, cache: KVCache, buffers: ChunkBuffers | None = None
              ) -> tuple[PrefillJob, PlanRun]:
        """The job of `plan` and its executor run, not yet stepped (a chunk's embedding rows are looked up as its first
        node starts)."""
        job = PrefillJob(self, plan, cache, buffers)
        dag, runs = plan.dag, job.nodes.runs
        by_kind = [runs[kind] for kind in dag.kinds]
        m = len(dag.layer_subgraphs)
        # node v: run(i, layer), and whether it is chunk i's first
        calls = [(by_kind[k], i, j // m, j == 0) for k, i, j in zip(dag.kind, dag.chunk, dag.j)]

        def run(v: int) -> None:
            fn, i, layer, first = calls[v]
            if first:
                job.embed(i)
            fn(i, layer)

        return job, self.executor.start(dag, run)

    def execute(self, plan: PrefillPlan, cache: KVCache) -> tuple[PrefillJob, Schedule]:
        """Run every subgraph of `plan`, writing K/V into `cache` (whose length is not yet advanced)."""
        job, run = self.start(plan, cache)
        run.step(None)
        return job, run.schedule()

    def commit(self, job: PrefillJob, schedule: Schedule, t0: float) -> PrefillResult:
        """The last real token's logits; only now the cache's length grows (a failed prefill leaves it)."""
        plan, cache = job.plan, job.cache
        job.check()
        last = plan.chunks[-1]
        logits = self.head(self, job.h[-1][last.n_valid - 1 : last.n_valid])[0]
        n = plan.ids.size
        if cache.length != plan.start:
            raise ConfigError(f"the cache moved during the prefill: {cache.length} positions, the plan started at "
                              f"{plan.start}")
        cache.advance(n)
        dag = plan.dag
        chunk_ms = tuple(max(schedule.end_us[i * dag.per_chunk: (i + 1) * dag.per_chunk]) / 1e3
                         for i in range(len(plan.chunks)))
        return PrefillResult(cache, logits, n, plan.start, chunk_ms, (time.perf_counter() - t0) * 1e3, schedule)

    def prefill(self, ids: object, cache: KVCache | None = None) -> PrefillResult:
        """Prefill `ids`, continuing `cache` at position P = cache.length if given (the next turn).

        The cache is extended in place (the returned result holds that same cache): to keep the earlier
        state, pass `cache.fork()`.
        """
        steps = self.prefill_steps(ids, cache, slice_s=None)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def prefill_steps(self, ids: object, cache: KVCache | None = None,
                      slice_s: float | None = 0.1, contended: Callable[[], bool] | None = None
                      ) -> Generator[int, None, PrefillResult]:
        """`prefill` as one plan run in slices of about `slice_s` seconds: yields between slices (nothing of
        this plan runs then) the tokens still to prefill (in proportion to the subgraphs left), returns the
        PrefillResult. Closing it early leaves `cache` as it was. `contended`: asked when a slice's time is
        up; while it says no one else waits, the plan runs on without pausing (a lone request's prefill is
        one uninterrupted run, as `prefill`'s).
        The result's times are wall times from the first slice, the gaps between slices included."""
        if cache is not None:
            check_cache(cache, self.cfg)
        start = cache.length if cache is not None else 0
        plan = self.plan(ids, start)
        if cache is None:
            cache = self.new_cache()
        cache.reserve(plan.ids.size)
        with self._busy:
            bufs = self._spare.pop() if self._spare else ChunkBuffers(self.model, self.host_plan.chunks)
        try:
            t0 = time.perf_counter()
            with self._busy, torch_threads(self.execution.lane_threads):
                job, run = self.start(plan, cache, bufs)
                done = run.step(slice_s, contended)
            n, total = plan.ids.size, plan.dag.n_nodes
            while not done:
                yield max(1, round(n * (total - run.n_done) / total))
                with self._busy, torch_threads(self.execution.lane_threads):
                    done = run.step(slice_s, contended)
            return self.commit(job, run.schedule(), t0)
        finally:
            with self._busy:
                self._spare.append(bufs)
