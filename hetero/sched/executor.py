"""Real execution of a prefill DAG: one worker thread per lane, dispatch by a policy (mllm-NPU §3.4).

The calling thread asks the policy for a node for every idle lane, hands it to that lane's worker and
releases successors on completion (Eq. 2-3); a lane runs one subgraph at a time (Eq. 4). When a node
raises, the running ones finish and `ScheduleError` names it; workers survive for the next prefill.
A run (`LaneRun`) can be stepped in slices: when a slice's time is up it dispatches nothing more, waits
for the running subgraphs (a wave boundary) and returns; the next step resumes with the same policy
state. `OutOfOrderExecutor` is the runtime's `PrefillExecutor` built on this.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Callable, Mapping, Sequence

from hetero.dag import LANES
from hetero.errors import ConfigError, ScheduleError
from hetero.nodes import DEFAULT_PLACEMENT
from hetero.sched.costs import CompiledDag, prefill_dag, with_costs
from hetero.sched.policy import POLICIES, Dispatcher, PolicyFactory
from hetero.sched.learned import CostLearner, learned_path
from hetero.sched.profile import Profile
from hetero.sched.measure import host_profile
from hetero.runtime import SerialRun
from hetero.schedule import Schedule
from hetero.threads import set_torch_threads, torch_threads

NodeFn = Callable[[int], None]  # runs the subgraph of node id v (see CompiledDag.node_info)


def node_error(dag: CompiledDag, v: int, err: BaseException) -> ScheduleError:
    """The error a prefill raises when node v raised `err`: which subgraph of which chunk and layer."""
    chunk, layer, kind = dag.node_info(v)
    return ScheduleError(f"subgraph {kind} of chunk {chunk}, layer {layer} (node {v}) on lane {dag.lane_of(v)} "
                         f"raised {type(err).__name__}: {err}")


class LaneWorkers:
    """A reusable set of lane workers. Use as a context manager or call `close()`.

    torch_threads: lane -> (shared, alone): the torch thread count of that lane's worker while another lane
    runs a node, and while it runs the only one (its OpenMP team is per thread). On a host whose lanes
    share the cores (the CPU EP standing in for the NPU), a lane alone can use every core.
    """

    def __init__(self, lanes: Sequence[str] = ("npu", "cpu"),
                 sync: Mapping[str, Callable[[], None]] | None = None,
                 torch_threads: Mapping[str, tuple[int, int]] | None = None) -> None:
        bad = [ln for ln in lanes if ln not in LANES]
        if bad or not lanes or len(set(lanes)) != len(lanes):
            raise ConfigError(f"lanes must be distinct names from {LANES}, got {tuple(lanes)}")
        threads = dict(torch_threads or {})
        wrong = {ln: t for ln, t in threads.items()
                 if ln not in lanes or len(t) != 2 or not 1 <= t[0] <= t[1]}
        if wrong:
            raise ConfigError(f"torch_threads must map lanes of {tuple(lanes)} to (shared, alone) counts with "
                              f"1 <= shared <= alone, got {wrong}")
        self.lanes = tuple(lanes)
        self._sync = dict(sync or {})
        self._torch_threads = threads
        self.inbox: dict[str, queue.SimpleQueue] = {ln: queue.SimpleQueue() for ln in self.lanes}
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.run_ids = itertools.count()
        self.lock = threading.Lock()  # one prefill at a time
        self.closed = False
        self._threads = [threading.Thread(target=self._worker, args=(ln,), name=f"hetero-lane-{ln}", daemon=True)
                         for ln in self.lanes]
        for t in self._threads:
            t.start()

    def _worker(self, lane: str) -> None:
        inbox, done, sync, clock = self.inbox[lane], self.done, self._sync.get(lane), time.perf_counter
        counts, now = self._torch_threads.get(lane), 0
        while True:
            item = inbox.get()
            if item is None:
                return
            run_id, v, fn, alone = item
            if counts is not None and counts[alone] != now:  # this thread's OpenMP team only
                now = counts[alone]
                set_torch_threads(now)
            t0 = clock()
            try:
                fn(v)
                if sync is not None:
                    sync()
                err = None
            except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises it
                err = e
            done.put((run_id, v, t0, clock(), err))

    def run(self, dag: CompiledDag, policy: str | PolicyFactory, work: NodeFn | Mapping[str, NodeFn],
            seed: int = 0, timeout_s: float | None = None) -> Schedule:
        """Execute every node of `dag` once, in an order chosen by `policy`; return the real Schedule.

        `work` is one callable for all lanes or a mapping lane -> callable. `timeout_s` bounds the wait
        for any single completion (None: wait forever).
        """
        run = self.start(dag, policy, work, seed, timeout_s)
        run.step(None)
        return run.schedule()

    def start(self, dag: CompiledDag, policy: str | PolicyFactory, work: NodeFn | Mapping[str, NodeFn],
              seed: int = 0, timeout_s: float | None = None,
              on_finish: Callable[[Schedule], None] | None = None) -> "LaneRun":
        """A run of `dag` to be stepped (`LaneRun.step`); `on_finish` gets its Schedule when it is done."""
        if self.closed:
            raise ScheduleError("executor is closed")
        missing = [ln for ln in dag.lanes if ln not in self.inbox]
        if missing:
            raise ConfigError(f"DAG needs lanes {missing} that this executor lacks (it has {self.lanes})")
        if isinstance(work, Mapping):
            lack = [ln for ln in dag.lanes if ln not in work]
            if lack:
                raise ConfigError(f"work has no callable for lanes {lack}")
            fns = [work[ln] for ln in dag.lanes]
        else:
            fns = [work] * len(dag.lanes)
        return LaneRun(self, dag, policy, fns, seed, timeout_s, on_finish)

    def close(self) -> None:
        """Stop and join the workers (each finishes the node it is running first)."""
        if self.closed:
            return
        self.closed = True
        for ln in self.lanes:
            self.inbox[ln].put(None)
        for t in self._threads:
            t.join()

    def __enter__(self) -> "LaneWorkers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LaneRun:
    """One DAG on a `LaneWorkers`, advanced by `step`: the policy's state lives across steps."""

    def __init__(self, workers: LaneWorkers, dag: CompiledDag, policy: str | PolicyFactory, fns: list[NodeFn],
                 seed: int, timeout_s: float | None, on_finish: Callable[[Schedule], None] | None):
        self.workers, self.dag, self.fns, self.timeout_s, self.on_finish = workers, dag, fns, timeout_s, on_finish
        self.run_id = next(workers.run_ids)
        t0 = time.perf_counter_ns()
        self.disp = Dispatcher(dag, policy, seed)
        self.sched_ns = time.perf_counter_ns() - t0
        self.start_us, self.end_us = [0.0] * dag.n_nodes, [0.0] * dag.n_nodes
        self.t_origin: float | None = None
        self._schedule: Schedule | None = None

    def step(self, budget_s: float | None, contended: Callable[[], bool] | None = None) -> bool:
        """Dispatch and collect until every node ran (True) or `budget_s` passed and `contended()` (if given)
        says someone waits; then drain (False)."""
        if self._schedule is not None:
            return True
        w = self.workers
        if w.closed:
            raise ScheduleError("executor is closed")
        with w.lock:
            finished = self._step(budget_s, contended)
        if finished:
            dag, n = self.dag, self.dag.n_nodes
            self._schedule = Schedule.of_run(self.disp.policy.name, dag, self.start_us, self.end_us,
                                             self.sched_ns / 1e3 / max(n, 1))
            if self.on_finish is not None:
                self.on_finish(self._schedule)
        return finished

    def _step(self, budget_s: float | None, contended: Callable[[], bool] | None) -> bool:
        clock_ns, clock = time.perf_counter_ns, time.perf_counter
        w, dag, disp, fns, run_id = self.workers, self.dag, self.disp, self.fns, self.run_id
        inboxes = [w.inbox[ln] for ln in dag.lanes]
        n, lane_of = dag.n_nodes, dag.lane
        start, end = self.start_us, self.end_us
        if self.t_origin is None:
            self.t_origin = clock()
        t_origin = self.t_origin
        deadline = None if budget_s is None else clock() + budget_s
        idle = [True] * len(dag.lanes)
        in_flight = 0
        failed: tuple[int, BaseException] | None = None
        stopping = False
        while True:
            if failed is None and not stopping:
                t0 = clock_ns()
                started = disp.fill(idle)
                for ln, v in started:  # alone: every other lane idle, so its cores are free for this one
                    in_flight += 1
                    inboxes[ln].put((run_id, v, fns[ln], in_flight == 1 and len(started) == 1))
                self.sched_ns += clock_ns() - t0
            if in_flight == 0:
                break
            try:
                rid, v, ts, te, err = w.done.get(timeout=self.timeout_s)
            except queue.Empty:
                raise ScheduleError(f"no subgraph completed within {self.timeout_s} s ({in_flight} running)") from None
            if rid != run_id:  # a straggler from an interrupted earlier run
                continue
            in_flight -= 1
            idle[lane_of[v]] = True
            start[v], end[v] = (ts - t_origin) * 1e6, (te - t_origin) * 1e6
            if err is not None:
                if failed is None:
                    failed = (v, err)
                continue
            t0 = clock_ns()
            disp.complete(v)
            self.sched_ns += clock_ns() - t0
            if deadline is not None and te >= deadline:
                if contended is None or contended():
                    stopping = True  # a wave boundary: let the running ones finish, dispatch nothing new
                else:
                    deadline = te + budget_s  # nobody waits: run on without draining the lanes
        if failed is not None:
            v, err = failed
            raise node_error(dag, v, err) from err
        if disp.finished:
            return True
        if stopping:
            return False
        raise ScheduleError(f"policy {disp.policy.name!r} deadlocked: {n - disp.n_done} of {n} subgraphs never ran")

    @property
    def n_done(self) -> int:
        return self.disp.n_done

    def schedule(self) -> Schedule:
        if self._schedule is None:
            raise ScheduleError(f"the run is not finished ({self.disp.n_done} of {self.dag.n_nodes} subgraphs ran)")
        return self._schedule


def execute(dag: CompiledDag, policy: str | PolicyFactory, work: NodeFn | Mapping[str, NodeFn],
            seed: int = 0, sync: Mapping[str, Callable[[], None]] | None = None) -> Schedule:
    """Run `dag` once on fresh lane workers (see `LaneWorkers.run`); for repeated prefills keep a LaneWorkers."""
    with LaneWorkers(dag.lanes, sync=sync) as ex:
        return ex.run(dag, policy, work, seed=seed)


class ChainRun(SerialRun):
    """A one-chunk DAG (a chain, Eq. 3) in program order on the calling thread, torch on `threads` cores (a
    lane alone) while it steps; a failing node is named like the lanes name it."""

    def __init__(self, dag: CompiledDag, run: NodeFn, threads: int | None):
        def guarded(v: int) -> None:
            try:
                run(v)
            except Exception as e:
                raise node_error(dag, v, e) from e

        super().__init__("serial", dag, guarded)
        self.threads = threads

    def step(self, budget_s: float | None, contended: Callable[[], bool] | None = None) -> bool:
        if not self.threads:
            return super().step(budget_s, contended)
        with torch_threads(self.threads):
            return super().step(budget_s, contended)


class OutOfOrderExecutor:
    """A `hetero.runtime.PrefillExecutor` that dispatches by `policy` on one worker per lane (§3.4).

    Keeps the lane workers alive across prefills and the compiled DAG per chunk count. Costs only steer
    the policy: `profile` when given; else this host's measured one (a shipped one on an unknown host),
    which then follows the host: with `learn_key` (the model and method) every multi-chunk prefill's real
    durations update running averages persisted per host (`sched.learned`), and the DAGs are recompiled
    from them every `RELEARN_EVERY` prefills. With no entry for this C the nearest profiled C stands in.
    torch_threads: per lane, torch's thread count while another lane runs and while it runs alone
    (`LaneWorkers`): lanes that share the host's cores take all of them when alone.
    """

    RELEARN_EVERY = 4
    chunks_in_flight = None  # the policy may start any ready node: a buffer set per chunk (`runtime.ChunkBuffers`)

    def __init__(self, n_layers: int, chunk: int, policy: str, profile: Profile | None = None,
                 placement: tuple[tuple[str, str], ...] = DEFAULT_PLACEMENT,
                 torch_threads: tuple[int, int] | None = None, learn_key: str | None = None):
        if policy not in POLICIES:
            raise ConfigError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
        self.learner = None
        if profile is None and learn_key is not None:  # (a host profile that costs this placement's kinds)
            self.learner = CostLearner(host_profile(placement), chunk, learned_path(learn_key))
            profile = self.learner.profile()
        self.profile = profile or host_profile(placement)
        self.n_layers, self.chunk, self.policy, self.placement = n_layers, chunk, policy, tuple(placement)
        have = self.profile.chunk_lens
        self.cost_chunk = min(have, key=lambda c: (abs(c - chunk), c)) if have else chunk
        self._dags: dict[tuple[int, frozenset[str]], CompiledDag] = {}
        self.torch_threads = torch_threads
        lanes = tuple(dict.fromkeys(lane for _, lane in self.placement))
        self.workers = LaneWorkers(lanes, torch_threads=dict.fromkeys(lanes, torch_threads) if torch_threads else None)

    def compile(self, n_chunks: int, reads_kv: frozenset[str]) -> CompiledDag:
        dag = self._dags.get((n_chunks, reads_kv))
        if dag is None:
            dag = self._dags[n_chunks, reads_kv] = with_costs(
                prefill_dag(n_chunks, self.placement, self.n_layers, reads_kv=reads_kv), self.profile, self.cost_chunk)
        return dag

    def start(self, dag: CompiledDag, run: NodeFn) -> "LaneRun | ChainRun":
        if dag.n_chunks == 1:  # one chunk is a chain (Eq. 3): nothing overlaps, so skip the lane hand-offs
            return ChainRun(dag, run, self.torch_threads[1] if self.torch_threads else None)
        # only overlapped runs are learnt from: their durations are what the policy orders
        return self.workers.start(dag, self.policy, run,
                                  on_finish=None if self.learner is None else lambda s: self._learn(dag, s))

    def execute(self, dag: CompiledDag, run: NodeFn) -> Schedule:
        r = self.start(dag, run)
        r.step(None)
        return r.schedule()

    def _learn(self, dag: CompiledDag, schedule: Schedule) -> None:
        learner = self.learner
        learner.observe(dag, schedule)
        if learner.n_observed % self.RELEARN_EVERY == 0:
            self.profile, self.cost_chunk = learner.profile(), self.chunk
            self._dags.clear()
            learner.save()

    def close(self) -> None:
        self.workers.close()
        if self.learner is not None:
            self.learner.save()
