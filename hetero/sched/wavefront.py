"""Whole-layer graphs of a prefill on several single-threaded lanes, chunk by chunk as a wavefront.

Where the "NPU" is the CPU itself, a chunk's layer runs as one ONNX Runtime graph (`npu.nodes.LAYER_PLACEMENT`). Run on
one 2-thread intra-op pool, every op of that graph splits over both cores and each split wakes a sleeping pool
thread: on this project's 2-core VM the second thread often arrives after a 64-row op is done (a [256, 1536]
QuickGelu: 113 µs on 1 thread, 123 µs on 2 threads without spinning, 64 µs with), and spinning pools lose 1.6–1.9×
as soon as another process wants a core (docs/journal.md, "Issue 24 item 2: the int8 GEMMs"). The prefill DAG itself
has the parallelism instead (mllm-NPU §3.4, Eq. 2–3): chunk i's layer l needs only chunk i's layer l−1 and chunk
i−1's layer l (its K/V). So chunk i runs on lane i mod k, each lane a thread whose sessions use one core, and the
lanes advance as a wavefront; the host plan cuts a prompt into at least k chunks of equal work (`chunking.ChunkRule`,
`chunking.balanced_chunks`) so that a short one has work for every lane. Each node runs exactly the kernels it would run alone, so the result equals a one-thread in-order
prefill with the same chunks bit for bit.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from hetero.dag import LANES, CompiledDag, prefill_dag
from hetero.errors import ConfigError
from hetero.schedule import Schedule

# A row's attention cost per key it attends, relative to its cost in the layer's other work (the INT8 graphs), one
# lane, SmolLM2-135M on the 2-core Zen 4 EPYC (docs/journal.md, "Issue 24 (session 14)"): a layer of 256 rows costs
# ~5.9 ms in its graphs and ~1.0 ms of BF16 attention per 256×256 block of keys (`native.attention`), ~2.5 ms with
# ONNX Runtime's fp32 GroupQueryAttention. It only shapes the chunks (`chunking.balanced_chunks`), never the result.
ATTENTION_PER_KEY = {"bf16": 6.6e-4, "gqa": 1.65e-3}


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
    """Whole layers on `lanes` single-threaded lanes (`runtime.PrefillExecutor`); the runtime's host plan cuts each
    prompt so that every lane has a chunk (`chunking.ChunkRule` with these lanes). The second lane is named "cpu" in the
    schedule (`dag.LANES`): it is the second core, running the same kind of graph as the first.

    placement: the (kind, lane) of one layer's nodes, every one of a chunk on its lane whatever lane it names: a whole
    layer as one node (`npu.nodes.LAYER_PLACEMENT`), or as its two halves around an attention kernel between two graphs
    (`npu.nodes.HALF_PLACEMENT`): then the next chunk's lane starts a layer after the attention of this one, not after
    its FFN."""

    chunk = None  # its DAGs do not depend on the chunk length (`runtime.PrefillExecutor.chunk`)

    def __init__(self, n_layers: int, placement: tuple[tuple[str, str], ...], lanes: int = 2):
        if lanes not in (1, 2):
            raise ConfigError(f"lanes must be 1 or 2, got {lanes}")
        self.n_layers, self.lanes, self.placement = n_layers, lanes, tuple(placement)
        self.chunks_in_flight = lanes  # a lane runs its chunks one after another (`WavefrontRun._lane`)
        self._dags: dict[tuple[int, frozenset[str]], CompiledDag] = {}
        self._pool: ThreadPoolExecutor | None = None  # the lanes after the first, made at the first start

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
