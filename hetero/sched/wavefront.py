"""Whole-layer graphs of a prefill on several single-threaded lanes, chunk by chunk as a wavefront.

Where the "NPU" is the CPU itself, a chunk's layer runs as one ONNX Runtime graph (`npu.nodes.LAYER_PLACEMENT`). Run on
one 2-thread intra-op pool, every op of that graph splits over both cores and each split wakes a sleeping pool
thread: on this project's 2-core VM the second thread often arrives after a 64-row op is done (a [256, 1536]
QuickGelu: 113 µs on 1 thread, 123 µs on 2 threads without spinning, 64 µs with), and spinning pools lose 1.6–1.9×
as soon as another process wants a core (docs/journal.md, "Issue 24 item 2: the int8 GEMMs"). The prefill DAG itself
has the parallelism instead (mllm-NPU §3.4, Eq. 2–3): chunk i's layer l needs only chunk i's layer l−1 and chunk
i−1's layer l (its K/V). So chunk i runs on lane i mod k, each lane a thread whose sessions use one core, and the
lanes advance as a wavefront; a prompt is cut into at least k chunks (`lane_chunk`) so that a short one has work
for every lane. Each node runs exactly the kernels it would run alone, so the result equals a one-thread in-order
prefill with the same chunks bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from hetero.chunking import Chunk, plan_chunks
from hetero.dag import LANES, CompiledDag, prefill_dag
from hetero.errors import ConfigError
from hetero.schedule import Schedule

MIN_CHUNK = 8  # rows below which a chunk's GEMMs are too thin to be worth a lane of their own
# A row's attention cost per key it attends, relative to its cost in the layer's other work (the INT8 graphs), one
# lane, SmolLM2-135M on the 2-core Zen 4 EPYC (docs/journal.md, "Issue 24 (session 14)"): a layer of 256 rows costs
# ~5.9 ms in its graphs and ~1.0 ms of BF16 attention per 256×256 block of keys (`native.attention`), ~2.5 ms with
# ONNX Runtime's fp32 GroupQueryAttention. It only shapes the chunks (`balanced_chunks`), never the result.
ATTENTION_PER_KEY = {"bf16": 6.6e-4, "gqa": 1.65e-3}


def lane_chunk(n_tokens: int, chunk: int, lanes: int) -> int:
    """The chunk length for a prompt of `n_tokens` on `lanes` lanes: at most the runtime's `chunk`, and short enough
    that the prompt has a multiple of `lanes` chunks of equal length (each lane as many: 40 tokens → 20 + 20, not
    32 + 8), but not below `MIN_CHUNK` (a prompt of fewer than 2·8 tokens is one chunk)."""
    if n_tokens <= 0 or chunk <= 0 or lanes <= 0:
        raise ConfigError(f"n_tokens, chunk and lanes must be > 0, got {n_tokens}, {chunk}, {lanes}")
    n_chunks = lanes * math.ceil(n_tokens / (lanes * chunk))
    return min(chunk, max(MIN_CHUNK, math.ceil(n_tokens / n_chunks)))


OVERSIZE = 1.5  # a balanced chunk may hold up to this many times the runtime's C rows (the first ones of a prompt)


def balanced_chunks(n_tokens: int, chunk: int, lanes: int, start: int = 0, per_key: float = 0.0) -> list[Chunk]:
    """`n_tokens` new rows from position `start` cut into chunks of equal work, as many as the lanes share evenly
    (`lane_chunk`'s count, more where one would exceed `OVERSIZE`·C rows). A row at position p costs 1 + per_key·p
    (its attention grows with the keys before it), so later chunks are shorter: with equal chunks the lane holding
    the later ones finishes last (1024 tokens in 4 chunks: 5 blocks of attention on one lane, 3 on the other), and in
    the wavefront each chunk's layer waits for the one before it. Measured at 1024 / 2048 tokens: 0.95 / 0.96× the
    time of equal chunks (304 + 272 + 240 + 208 rows instead of 4 × 256); capped at C instead (more, shorter chunks)
    0.98 / 0.97×. Boundaries fall on multiples of `MIN_CHUNK` where chunks are long."""
    first = lane_chunk(n_tokens, chunk, lanes)
    n_chunks = math.ceil(n_tokens / first)
    if n_chunks == 1 or per_key <= 0:
        return plan_chunks(n_tokens, first, start, any_rows=True)

    def work(p: float) -> float:  # the cost of rows start..start+p, relative to a row with no keys
        return p + per_key * ((start + p) ** 2 - start**2) / 2

    while True:
        align = MIN_CHUNK if n_tokens >= 8 * MIN_CHUNK * n_chunks else 1  # (short chunks: rounding would unbalance them)
        total, bounds = work(n_tokens), [0]
        for k in range(1, n_chunks):  # work(b) = k/n of the total: the quadratic's positive root
            target = total * k / n_chunks
            b = (math.sqrt((1 + per_key * start) ** 2 + 2 * per_key * target) - 1 - per_key * start) / per_key
            bounds.append(min(n_tokens - 1, max(bounds[-1] + 1, align * round(b / align))))
        bounds.append(n_tokens)
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        if max(sizes) <= OVERSIZE * chunk or n_chunks >= n_tokens:
            break
        n_chunks += lanes  # the first chunk would exceed C: more chunks, still a multiple of the lanes
    return [Chunk(i, start + a, b - a, b - a) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


class WavefrontRun:
    """One DAG's nodes on `lanes` threads (the calling one and lanes − 1 helpers): chunk i's nodes in order on lane
    i mod lanes, each after its predecessors; `step` by `step` (`runtime.PlanRun`)."""

    def __init__(self, dag: CompiledDag, run: Callable[[int], None], lanes: int,
                 pool: ThreadPoolExecutor | None = None):
        # pool: the executor's threads for the lanes after the first (None with one lane). The same threads every
        # step: a new thread per prefill cost a 64-token prefill 1.2-1.3x its time (docs/journal.md, "Issue 24
        # (session 15)")
        self.dag, self.run, self.lanes, self.pool = dag, run, lanes, pool
        n = dag.n_nodes
        self._done = [False] * n
        self._next = [0] * dag.n_chunks  # per chunk: its next node's index in the chunk
        self.start_us, self.end_us = [0.0] * n, [0.0] * n
        self._n_done = 0
        self._cv = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self.t_origin: float | None = None
        # the nodes another lane may wait for: a lane is woken only when one of them ends (each wake of a lane whose
        # node is not ready yet takes the interpreter lock from the one that runs)
        self._wakes = [any(dag.lane[u] != dag.lane[v] for u in dag.successors(v)) for v in range(n)]

    @property
    def n_done(self) -> int:
        return self._n_done

    def _ready(self, v: int) -> bool:
        d = self.dag
        return all(self._done[u] for u in d.pred_idx[d.pred_ptr[v]: d.pred_ptr[v + 1]])

    def _lane(self, k: int, deadline: list[float | None], budget_s: float | None,
              contended: Callable[[], bool] | None) -> None:
        clock, per_chunk, cv = time.perf_counter, self.dag.per_chunk, self._cv
        try:
            for i in range(k, self.dag.n_chunks, self.lanes):
                while self._next[i] < per_chunk:
                    v = i * per_chunk + self._next[i]
                    with cv:
                        cv.wait_for(lambda: self._stop or self._ready(v))
                        if self._stop:
                            return
                    t0 = clock()
                    self.run(v)
                    t1 = clock()
                    with cv:
                        self.start_us[v], self.end_us[v] = (t0 - self.t_origin) * 1e6, (t1 - self.t_origin) * 1e6
                        self._done[v] = True
                        self._next[i] += 1
                        self._n_done += 1
                        if deadline[0] is not None and t1 >= deadline[0] and self._n_done < self.dag.n_nodes:
                            if contended is None or contended():
                                self._stop = True
                            else:
                                deadline[0] = t1 + budget_s  # nobody waits: run on, without a pause
                        if self._wakes[v] or self._stop:
                            cv.notify_all()
        except BaseException as e:  # re-raised by `step` on the calling thread
            with cv:
                self._error = self._error or e
                self._stop = True
                cv.notify_all()

    def step(self, budget_s: float | None, contended: Callable[[], bool] | None = None) -> bool:
        clock = time.perf_counter
        if self.t_origin is None:
            self.t_origin = clock()
        self._stop = False
        deadline = [None if budget_s is None else clock() + budget_s]
        others = range(1, min(self.lanes, self.dag.n_chunks))
        if others and self.pool is None:
            raise ConfigError(f"a wavefront of {self.lanes} lanes needs the executor's pool of lane threads")
        helpers = [self.pool.submit(self._lane, k, deadline, budget_s, contended) for k in others]
        self._lane(0, deadline, budget_s, contended)
        for f in helpers:
            f.result()
        if self._error is not None:
            raise self._error
        return self._n_done == self.dag.n_nodes

    def schedule(self) -> Schedule:
        if self._n_done != self.dag.n_nodes:
            raise ConfigError(f"the plan ran {self._n_done} of {self.dag.n_nodes} subgraphs: no schedule yet")
        return Schedule.of_run("wavefront", self.dag, self.start_us, self.end_us, decision_us=0.0)


class WavefrontExecutor:
    """Whole layers on `lanes` single-threaded lanes (`runtime.PrefillExecutor`); the runtime cuts each prompt into
    `chunks_for` rows so that every lane has a chunk. The second lane is named "cpu" in the schedule (`dag.LANES`): it
    is the second core, running the same kind of graph as the first.

    placement: the (kind, lane) of one layer's nodes, every one of a chunk on its lane whatever lane it names: a whole
    layer as one node (`npu.nodes.LAYER_PLACEMENT`), or as its two halves around an attention kernel between two graphs
    (`npu.nodes.HALF_PLACEMENT`): then the next chunk's lane starts a layer after the attention of this one, not after
    its FFN."""

    def __init__(self, n_layers: int, placement: tuple[tuple[str, str], ...], lanes: int = 2,
                 attention_per_key: float = 0.0):
        if lanes not in (1, 2):
            raise ConfigError(f"lanes must be 1 or 2, got {lanes}")
        if attention_per_key < 0:
            raise ConfigError(f"attention_per_key must be >= 0, got {attention_per_key}")
        self.n_layers, self.lanes, self.placement = n_layers, lanes, tuple(placement)
        self.attention_per_key = attention_per_key  # `ATTENTION_PER_KEY` of the backend's attention (0: equal chunks)
        self._dags: dict[tuple[int, frozenset[str]], CompiledDag] = {}
        self._pool: ThreadPoolExecutor | None = None  # the lanes after the first, made at the first start

    def chunks_for(self, n_tokens: int, chunk: int, start: int) -> list[Chunk]:
        """The chunks of a prompt (`balanced_chunks`): a multiple of the lanes, equal work, at most `OVERSIZE`·C rows."""
        return balanced_chunks(n_tokens, chunk, self.lanes, start, self.attention_per_key)

    def compile(self, n_chunks: int, reads_kv: frozenset[str]) -> CompiledDag:
        dag = self._dags.get((n_chunks, reads_kv))
        if dag is None:  # the lanes named as the scheduler's (`dag.LANES`): chunk i's layers on lane i mod k
            dag = prefill_dag(n_chunks, self.placement, self.n_layers, reads_kv=reads_kv)
            dag = self._dags[n_chunks, reads_kv] = dataclasses.replace(dag, lanes=LANES[: self.lanes],
                                                                       lane=tuple(c % self.lanes for c in dag.chunk))
        return dag

    def start(self, dag: CompiledDag, run: Callable[[int], None]) -> WavefrontRun:
        if self._pool is None and self.lanes > 1:
            self._pool = ThreadPoolExecutor(self.lanes - 1, thread_name_prefix="hetero-lane")
        return WavefrontRun(dag, run, self.lanes, self._pool)

    def execute(self, dag: CompiledDag, run: Callable[[int], None]) -> Schedule:
        r = self.start(dag, run)
        r.step(None)
        return r.schedule()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
