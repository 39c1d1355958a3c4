"""Drive a `PrefillJob` out of order: DAG per chunk count, policy, one worker per lane (mllm-NPU §3.4).

This is the bridge between the runtime (which owns the tensors and executes G[i][j] via
`PrefillJob.run(i, layer, kind)`) and the scheduler (which only sees node ids, lanes and costs).
"""

from __future__ import annotations

import logging
from typing import Any

import networkx as nx

from hetero.errors import ConfigError
from hetero.paths import profile_search_path
from hetero.sched.dag import CompiledDag, build_dag, compile_dag
from hetero.sched.executor import Executor
from hetero.sched.policy import POLICIES
from hetero.sched.profile import Profile, load_profile
from hetero.sched.schedule import Schedule

log = logging.getLogger(__name__)


def host_profile() -> Profile:
    """This host's measured profile (`<host>.json`: the user's, else a shipped one), else any measured
    profile (`paths.profile_search_path`)."""
    from hetero.sched.profiling import host_slug

    folders = profile_search_path()
    for own in (d / f"{host_slug()}.json" for d in folders):
        if own.is_file():
            return load_profile(own)
    for path in (p for d in folders for p in sorted(d.glob("*.json"))):
        try:
            p = load_profile(path)
        except Exception:  # not a sched profile (e.g. an equivalent-shapes table)
            continue
        if p.method == "measured":
            log.info("no profile for this host; dispatching on the costs of %s", path.name)
            return p
    raise ConfigError(f"no measured profile in {' or '.join(map(str, folders))}: run `hetero profile` first")


class OutOfOrderRunner:
    """Keeps lane workers alive across prefills and caches the compiled DAG per chunk count."""

    def __init__(self, n_layers: int, chunk: int, policy: str, profile: Profile | None,
                 placement: tuple[tuple[str, str], ...]):
        if policy not in POLICIES:
            raise ConfigError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
        self.profile = profile or host_profile()
        self.n_layers, self.chunk, self.policy, self.placement = n_layers, chunk, policy, placement
        # Costs steer the policy only; with no entry for this C, the nearest profiled C stands in.
        have = self.profile.chunk_lens
        self.cost_chunk = min(have, key=lambda c: (abs(c - chunk), c)) if have else chunk
        self._dags: dict[int, CompiledDag] = {}
        lanes = tuple(dict.fromkeys(lane for _, lane in placement))
        self.executor = Executor(lanes)

    def dag(self, n_chunks: int) -> CompiledDag:
        dag = self._dags.get(n_chunks)
        if dag is None:
            graph: nx.DiGraph = build_dag(n_chunks, self.placement, self.n_layers)
            dag = self._dags[n_chunks] = compile_dag(graph, self.profile, self.cost_chunk)
        return dag

    def run(self, job: Any) -> tuple[Schedule, list[float]]:
        """Execute every subgraph of `job`; return the real schedule and each chunk's finish time (ms)."""
        dag = self.dag(len(job.chunks))
        info = [dag.node_info(v) for v in range(dag.n_nodes)]
        schedule = self.executor.run(dag, self.policy, lambda v: job.run(*info[v]))
        per_chunk = dag.per_chunk
        chunk_ms = [max(schedule.end_us[i * per_chunk: (i + 1) * per_chunk]) / 1e3 for i in range(len(job.chunks))]
        return schedule, chunk_ms

    def close(self) -> None:
        self.executor.close()
