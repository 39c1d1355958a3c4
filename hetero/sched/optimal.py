"""Exact reference for small prefill DAGs: CP-SAT (OR-Tools), to measure each policy's optimality gap.

The problem of §3.4 (Eq. 2-4, minimise the makespan) is NP-hard, so the paper schedules greedily (Eq. 6).
Offline we solve small instances: one interval per subgraph, `AddNoOverlap` per lane, an inequality per
edge; the best policy's schedule is a hint and the lower bound is posted. OR-Tools is optional (extra
`optimal`): `solve_optimal` raises MissingExtra if it is missing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hetero.extras import require
from hetero.sched.costs import CompiledDag
from hetero.schedule import Schedule

NS_PER_US = 1000


@dataclass(frozen=True, slots=True)
class OptimalResult:
    """Best makespan CP-SAT found within its time limit, and whether it is proven optimal."""

    makespan_us: float  # best schedule found (<= the hint's)
    bound_us: float  # proven lower bound on the optimum
    proven: bool  # makespan_us == the optimum
    wall_s: float
    status: str  # CP-SAT status name
    start_us: tuple[float, ...] = ()  # node -> start in the best schedule found

    def gap(self, makespan_us: float) -> float:
        """Relative gap of a policy's makespan to the best known optimum (proven if `proven`)."""
        return makespan_us / self.makespan_us - 1.0 if self.makespan_us > 0 else 0.0


def solve_optimal(dag: CompiledDag, time_limit_s: float = 10.0, hint: Schedule | None = None,
                  workers: int = 2) -> OptimalResult:
    """Minimise the makespan of `dag` exactly (CP-SAT) within `time_limit_s`."""
    require("optimal", "the optimal schedule (solve_optimal)")
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    dur = [max(0, round(c * NS_PER_US)) for c in dag.cost_us]
    horizon = sum(dur)
    lb = round(dag.lower_bound_us() * NS_PER_US) - dag.n_nodes  # minus rounding slack
    m = cp_model.CpModel()
    start = [m.NewIntVar(0, horizon, f"s{v}") for v in range(dag.n_nodes)]
    intervals: list[list] = [[] for _ in dag.lanes]
    for v in range(dag.n_nodes):
        intervals[dag.lane[v]].append(m.NewFixedSizeIntervalVar(start[v], dur[v], f"i{v}"))
        for p in dag.predecessors(v):
            m.Add(start[v] >= start[p] + dur[p])
    for ivs in intervals:
        m.AddNoOverlap(ivs)
    makespan = m.NewIntVar(max(lb, 0), horizon, "makespan")
    sinks = [v for v in range(dag.n_nodes) if dag.succ_ptr[v] == dag.succ_ptr[v + 1]]
    for v in sinks:
        m.Add(makespan >= start[v] + dur[v])
    m.Minimize(makespan)
    hint_ns = _replay(dag, hint, dur) if hint is not None else None
    if hint_ns is not None:
        for v in range(dag.n_nodes):
            m.AddHint(start[v], hint_ns[v])
        m.AddHint(makespan, max(hint_ns[v] + dur[v] for v in range(dag.n_nodes)))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    status = solver.Solve(m)
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return OptimalResult(float("inf"), solver.BestObjectiveBound() / NS_PER_US, False,
                             time.perf_counter() - t0, name)
    best = solver.ObjectiveValue() / NS_PER_US
    starts = tuple(solver.Value(s) / NS_PER_US for s in start)
    if hint_ns is not None and max(h + d for h, d in zip(hint_ns, dur)) / NS_PER_US < best:
        starts = tuple(h / NS_PER_US for h in hint_ns)  # CP-SAT did not improve on (or keep) the hint
        best = max(h + d for h, d in zip(hint_ns, dur)) / NS_PER_US
    return OptimalResult(
        makespan_us=best, bound_us=max(solver.BestObjectiveBound() / NS_PER_US, lb / NS_PER_US),
        proven=status == cp_model.OPTIMAL, wall_s=time.perf_counter() - t0, status=name,
        start_us=starts,
    )


def _replay(dag: CompiledDag, hint: Schedule, dur: list[int]) -> list[int]:
    """The hint's per-lane order replayed with the integer durations: a feasible integer schedule.

    (Rounding the hint's float start times directly can break a precedence by a nanosecond, and CP-SAT
    then drops the whole hint.)
    """
    order = sorted(range(dag.n_nodes), key=lambda v: (hint.start_us[v], v))
    lane_free = [0] * len(dag.lanes)
    start = [0] * dag.n_nodes
    done = [0] * dag.n_nodes
    for v in order:
        t = max([lane_free[dag.lane[v]], *(done[p] for p in dag.predecessors(v))])
        start[v], done[v] = t, t + dur[v]
        lane_free[dag.lane[v]] = done[v]
    return start
