"""Discrete-event simulation of a prefill DAG under a policy, on profiled costs (mllm-NPU §3.4).

The same `Dispatcher` and policy the executor uses, driven by a clock instead of lanes: at each event
every idle lane asks the policy for a node; the earliest completion advances the clock and releases
its successors (Eq. 2-3); a lane runs one node at a time (Eq. 4). Any number of lanes.
"""

from __future__ import annotations

import heapq
import time

from hetero.errors import ScheduleError
from hetero.sched.costs import CompiledDag
from hetero.sched.policy import Dispatcher, PolicyFactory
from hetero.schedule import Schedule


def simulate(dag: CompiledDag, policy: str | PolicyFactory = "rank", seed: int = 0) -> Schedule:
    """Simulate `dag` under `policy`; decision_us is the measured scheduler time per node."""
    clock = time.perf_counter_ns
    t0 = clock()
    disp = Dispatcher(dag, policy, seed)
    sched_ns = clock() - t0  # building the policy's tables counts as scheduling overhead
    n, n_lanes, cost, lane_of = dag.n_nodes, len(dag.lanes), dag.cost_us, dag.lane
    start, end = [0.0] * n, [0.0] * n
    idle = [True] * n_lanes
    events: list[tuple[float, int]] = []
    now = 0.0
    while True:
        t0 = clock()
        for ln, v in disp.fill(idle):
            start[v] = now
            end[v] = now + cost[v]
            heapq.heappush(events, (end[v], v))
        sched_ns += clock() - t0
        if not events:
            break
        now, v = heapq.heappop(events)
        done = [v]
        while events and events[0][0] == now:
            done.append(heapq.heappop(events)[1])
        t0 = clock()
        for v in done:
            disp.complete(v)
            idle[lane_of[v]] = True
        sched_ns += clock() - t0
    if not disp.finished:
        name = policy if isinstance(policy, str) else getattr(policy, "name", repr(policy))
        raise ScheduleError(f"policy {name!r} deadlocked: {n - disp.n_done} of {n} subgraphs never ran")
    return Schedule.of_run(disp.policy.name, dag, start, end, sched_ns / 1e3 / max(n, 1), simulated=True,
                           lower_bound_us=dag.lower_bound_us())
