"""Scheduling policies: which ready subgraph an idle lane runs next (mllm-NPU §3.4).

A policy only chooses; the `Dispatcher` tracks readiness (Eq. 2-3) and calls ``push(v)`` when v becomes
ready and ``pop(lane)`` when a lane is idle (-1: stay idle). Scores are precomputed tuples or per-lane
heaps, so a decision costs microseconds. Registry `POLICIES`: ``in_order`` (Fig. 13a), ``chunk_first``,
``eq6`` (the paper's Eq. 6), ``rank`` (ours: upward rank), ``random`` (tests). docs/design.md, "Scheduler".
"""

from __future__ import annotations

import abc
import heapq
import random
from typing import Callable

from hetero.errors import ConfigError
from hetero.sched.costs import CompiledDag


class Policy(abc.ABC):
    """Base: holds the DAG and the dispatcher's shared pending-predecessor counts."""

    name = "base"

    def __init__(self, dag: CompiledDag, pending: list[int], seed: int = 0) -> None:
        self.dag = dag
        self.pending = pending  # node -> unfinished predecessors (owned by the Dispatcher)

    @abc.abstractmethod
    def push(self, v: int) -> None:
        """Node v became ready."""

    @abc.abstractmethod
    def pop(self, lane: int) -> int:
        """The next node for idle `lane` (one of its ready nodes)."""

    def one_left(self, s: int) -> None:
        """Hook: s now waits for a single predecessor (Eq. 6 re-scores that predecessor)."""


class InOrder(Policy):
    """Fig. 13(a): per-lane program order, no skipping."""

    name = "in_order"

    def __init__(self, dag: CompiledDag, pending: list[int], seed: int = 0) -> None:
        super().__init__(dag, pending)
        self.seq: list[list[int]] = [[] for _ in dag.lanes]
        for v in range(dag.n_nodes):  # node ids are program order
            self.seq[dag.lane[v]].append(v)
        self.pos = [0] * len(dag.lanes)
        self.ready = bytearray(dag.n_nodes)

    def push(self, v: int) -> None:
        self.ready[v] = 1

    def pop(self, lane: int) -> int:
        seq, k = self.seq[lane], self.pos[lane]
        if k < len(seq) and self.ready[seq[k]]:
            self.pos[lane] = k + 1
            return seq[k]
        return -1


class StaticPriority(Policy):
    """Max-priority ready node per lane from a precomputed key (smaller key = sooner)."""

    def __init__(self, dag: CompiledDag, pending: list[int], seed: int = 0) -> None:
        super().__init__(dag, pending)
        self.key = self.keys(dag)
        self.heaps: list[list[tuple]] = [[] for _ in dag.lanes]

    @abc.abstractmethod
    def keys(self, dag: CompiledDag) -> list[tuple]:
        """Per-node heap keys: smaller runs first."""

    def push(self, v: int) -> None:
        heapq.heappush(self.heaps[self.dag.lane[v]], self.key[v])

    def pop(self, lane: int) -> int:
        h = self.heaps[lane]
        return heapq.heappop(h)[-1] if h else -1


class ChunkFirst(StaticPriority):
    name = "chunk_first"

    def keys(self, dag: CompiledDag) -> list[tuple]:
        return [(v,) for v in range(dag.n_nodes)]


def upward_rank(dag: CompiledDag) -> list[float]:
    """rank(v) = T(v) + max over successors s of rank(s): longest path from v to the end, v included."""
    return dag.upward_rank_us()


class Rank(StaticPriority):
    name = "rank"

    def keys(self, dag: CompiledDag) -> list[tuple]:
        return [(-r, v) for v, r in enumerate(upward_rank(dag))]


class Eq6(Policy):
    """mllm-NPU Eq. 6 with the dynamic S (see module docstring); lazy-invalidated heaps per lane."""

    name = "eq6"

    def __init__(self, dag: CompiledDag, pending: list[int], seed: int = 0) -> None:
        super().__init__(dag, pending)
        npu = dag.lanes.index("npu") if "npu" in dag.lanes else -1
        self.npu = npu
        # weight[s] as seen from a predecessor on the NPU (-T(s) if s is off the NPU) or off it (+T(s) if on it)
        self.w_from_npu = [0.0 if dag.lane[s] == npu else -dag.cost_us[s] for s in range(dag.n_nodes)]
        self.w_from_other = [dag.cost_us[s] if dag.lane[s] == npu else 0.0 for s in range(dag.n_nodes)]
        self.score = [0.0] * dag.n_nodes
        self.ready = bytearray(dag.n_nodes)  # ready and not yet popped
        self.heaps: list[list[tuple[float, int]]] = [[] for _ in dag.lanes]

    def _c(self, g: int) -> float:
        dag, pending = self.dag, self.pending
        w = self.w_from_npu if dag.lane[g] == self.npu else self.w_from_other
        si = dag.succ_idx
        return sum(w[si[k]] for k in range(dag.succ_ptr[g], dag.succ_ptr[g + 1]) if pending[si[k]] == 1)

    def push(self, v: int) -> None:
        c = self._c(v)
        self.score[v] = c
        self.ready[v] = 1
        heapq.heappush(self.heaps[self.dag.lane[v]], (-c, v))

    def pop(self, lane: int) -> int:
        h = self.heaps[lane]
        while h:
            negc, v = heapq.heappop(h)
            if self.ready[v] and -negc == self.score[v]:  # else a stale entry
                self.ready[v] = 0
                return v
        return -1

    def one_left(self, s: int) -> None:
        dag = self.dag
        for k in range(dag.pred_ptr[s], dag.pred_ptr[s + 1]):
            p = dag.pred_idx[k]
            if self.ready[p]:
                c = self._c(p)
                if c != self.score[p]:
                    self.score[p] = c
                    heapq.heappush(self.heaps[dag.lane[p]], (-c, p))


class RandomOrder(Policy):
    """A uniformly random ready node of the lane (seeded): for testing order-independence."""

    name = "random"

    def __init__(self, dag: CompiledDag, pending: list[int], seed: int = 0) -> None:
        super().__init__(dag, pending)
        self.rng = random.Random(seed)
        self.ready: list[list[int]] = [[] for _ in dag.lanes]

    def push(self, v: int) -> None:
        self.ready[self.dag.lane[v]].append(v)

    def pop(self, lane: int) -> int:
        r = self.ready[lane]
        if not r:
            return -1
        k = self.rng.randrange(len(r))
        r[k], r[-1] = r[-1], r[k]
        return r.pop()


PolicyFactory = Callable[[CompiledDag, list, int], Policy]
POLICIES: dict[str, PolicyFactory] = {
    "in_order": InOrder,
    "chunk_first": ChunkFirst,
    "eq6": Eq6,
    "rank": Rank,
    "random": RandomOrder,
}
DEFAULT_POLICY = "rank"


def get_policy(name: str) -> PolicyFactory:
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"policy must be one of {sorted(POLICIES)}, got {name!r}") from None


class Dispatcher:
    """Readiness bookkeeping shared by the simulator and the executor (the hot loop's state).

    ``next_for(lane)`` asks the policy for the lane's next node and marks it started;
    ``complete(v)`` releases v's successors (Eq. 2-3) and tells the policy which became ready.
    """

    __slots__ = ("dag", "pending", "policy", "n_done", "n_started", "_one_left")

    def __init__(self, dag: CompiledDag, policy: str | PolicyFactory, seed: int = 0) -> None:
        factory = get_policy(policy) if isinstance(policy, str) else policy
        self.dag = dag
        self.pending = list(dag.indeg)
        self.policy = factory(dag, self.pending, seed)
        self._one_left = type(self.policy).one_left is not Policy.one_left
        self.n_done = 0
        self.n_started = 0
        for v in range(dag.n_nodes):
            if self.pending[v] == 0:
                self.policy.push(v)

    @property
    def finished(self) -> bool:
        return self.n_done == self.dag.n_nodes

    def next_for(self, lane: int) -> int:
        v = self.policy.pop(lane)
        if v >= 0:
            self.n_started += 1
        return v

    def fill(self, idle: list[bool]) -> list[tuple[int, int]]:
        """Ask the policy for a node for every idle lane; mark those lanes busy; return (lane, node)s."""
        out = []
        for ln, free in enumerate(idle):
            if free:
                v = self.next_for(ln)
                if v >= 0:
                    idle[ln] = False
                    out.append((ln, v))
        return out

    def complete(self, v: int) -> None:
        dag, pending, policy = self.dag, self.pending, self.policy
        self.n_done += 1
        si = dag.succ_idx
        for k in range(dag.succ_ptr[v], dag.succ_ptr[v + 1]):
            s = si[k]
            left = pending[s] - 1
            pending[s] = left
            if left == 0:
                policy.push(s)
            elif left == 1 and self._one_left:
                policy.one_left(s)
