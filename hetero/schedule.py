"""`Schedule`: what a simulated or real prefill did, subgraph by subgraph (mllm-NPU §3.4, Fig. 13).

Per node start/end, lane busy times, the lower bound and the bubble rate of the critical lane (the lane
with the most work): ``1 - busy(critical lane) / makespan``, so ``makespan / lower_bound <= 1 / (1 -
bubble_rate)``. Core, because every prefill returns one (`PrefillResult.schedule`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from hetero.dag import CompiledDag


@dataclass(frozen=True, slots=True)
class Schedule:
    """Per-node placement and timing of one prefill, plus its summary figures.

    Invariants: every node ran exactly once on ``dag.lane[v]``; ``start_us[v] >= end_us[p]`` for each
    predecessor p (Eq. 2-3); intervals on one lane do not overlap (Eq. 4); times start at 0.
    """

    policy: str
    dag: CompiledDag = field(repr=False)
    start_us: tuple[float, ...]  # node -> start, µs from the start of the prefill
    end_us: tuple[float, ...]  # node -> end
    makespan_us: float
    busy_us: Mapping[str, float]  # lane -> time spent running subgraphs
    lower_bound_us: float  # >= max(each lane's work, critical path), CompiledDag.lower_bound_us
    decision_us: float  # mean scheduler time per dispatched subgraph (policy + bookkeeping)
    simulated: bool  # True: discrete-event simulation on profiled costs; False: a real run
    profile_name: str = ""

    @classmethod
    def of_run(cls, policy: str, dag: CompiledDag, start_us: Sequence[float], end_us: Sequence[float],
               decision_us: float, simulated: bool = False, lower_bound_us: float | None = None) -> "Schedule":
        """The Schedule of node intervals [start_us[v], end_us[v]]; lane busy times and (unless given) the
        lower bound come from these durations, so makespan_over_lb is about the order alone."""
        durations = tuple(e - s for s, e in zip(start_us, end_us))
        busy = dict.fromkeys(dag.lanes, 0.0)
        for v, d in enumerate(durations):
            busy[dag.lanes[dag.lane[v]]] += d
        return cls(policy=policy, dag=dag, start_us=tuple(start_us), end_us=tuple(end_us),
                   makespan_us=max(end_us, default=0.0), busy_us=busy,
                   lower_bound_us=lower_bound_us if lower_bound_us is not None
                   else dataclasses.replace(dag, cost_us=durations).lower_bound_us(),
                   decision_us=decision_us, simulated=simulated, profile_name=dag.profile_name)

    @property
    def critical_lane(self) -> str:
        work = self.dag.work_us()
        return max(work, key=work.get)

    @property
    def bubble_rate(self) -> float:
        if self.makespan_us <= 0:
            return 0.0
        return 1.0 - self.busy_us[self.critical_lane] / self.makespan_us

    def lane_bubble_rate(self, lane: str) -> float:
        return 1.0 - self.busy_us.get(lane, 0.0) / self.makespan_us if self.makespan_us > 0 else 0.0

    @property
    def makespan_over_lb(self) -> float:
        return self.makespan_us / self.lower_bound_us if self.lower_bound_us > 0 else 1.0

    def lane_order(self, lane: str) -> list[int]:
        """Nodes run on `lane`, in start order."""
        li = self.dag.lanes.index(lane)
        return sorted((v for v in range(self.dag.n_nodes) if self.dag.lane[v] == li), key=self.start_us.__getitem__)

    def summary(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "profile": self.profile_name, "simulated": self.simulated,
            "n_chunks": self.dag.n_chunks, "chunk_len": self.dag.chunk_len, "n_nodes": self.dag.n_nodes,
            "makespan_us": round(self.makespan_us, 3), "lower_bound_us": round(self.lower_bound_us, 3),
            "makespan_over_lb": round(self.makespan_over_lb, 5), "bubble_rate": round(self.bubble_rate, 5),
            "critical_lane": self.critical_lane, "busy_us": {k: round(v, 3) for k, v in self.busy_us.items()},
            "decision_us": round(self.decision_us, 3),
        }

    def to_dict(self) -> dict[str, Any]:
        """Summary plus one record per node (for saving a real run's timeline)."""
        d = self.summary()
        d["nodes"] = [
            {"id": v, "chunk": self.dag.chunk[v], "j": self.dag.j[v], "kind": self.dag.kinds[self.dag.kind[v]],
             "lane": self.dag.lane_of(v), "start_us": round(self.start_us[v], 3), "end_us": round(self.end_us[v], 3)}
            for v in range(self.dag.n_nodes)
        ]
        return d


def check_schedule(s: Schedule) -> None:
    """Assert the Schedule invariants (Eq. 2-4, nothing leaked). For tests and debugging."""
    dag, eps = s.dag, 1e-6
    assert len(s.start_us) == len(s.end_us) == dag.n_nodes
    for v in range(dag.n_nodes):
        assert s.end_us[v] >= s.start_us[v] >= 0.0, f"node {v} has bad times"
        for p in dag.predecessors(v):
            assert s.start_us[v] >= s.end_us[p] - eps, f"node {v} started before its predecessor {p} ended"
    for lane in dag.lanes:
        order = s.lane_order(lane)
        for a, b in zip(order, order[1:]):
            assert s.start_us[b] >= s.end_us[a] - eps, f"lane {lane} runs {a} and {b} at once"
    assert abs(s.makespan_us - max(s.end_us, default=0.0)) <= eps * max(1.0, s.makespan_us)
