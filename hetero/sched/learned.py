"""Costs that follow the host: every real prefill updates the costs the policy dispatches on.

mllm-NPU §3.4 profiles subgraph latencies offline. On a machine whose load changes, or a host nobody
profiled (the policy then starts from a shipped profile of another machine), offline costs drift from
what the lanes really take. `CostLearner` keeps, per (kind, lane) at the executor's chunk length C and
per KV length for attention, an exponential running average of the durations the executor measured
(its `Schedule`), and writes it back as a profile JSON per host and model, so the next process starts
where this one left off. The learned file is read first when it exists; the policy's priorities
(`sched.policy`) are recomputed from it every few prefills.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections import defaultdict
from pathlib import Path

from hetero.dag import CompiledDag
from hetero.errors import ConfigError
from hetero.paths import atomic_path, cache_unwritable, entry_lock, user_profiles_dir, verify, write_record
from hetero.schedule import Schedule
from hetero.sched.profile import CostEntry, Profile, load_profile
from hetero.sched.measure import KV_KINDS, host_slug

log = logging.getLogger(__name__)

ALPHA = 0.25  # weight of the newest prefill in a running average: about the last 4-8 prefills count


def learned_path(key: str) -> Path:
    """Where the learned costs of this host for model/method `key` live (`<cache>/profiles/learned/`)."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in key)
    if not safe:
        raise ConfigError("learned-cost key must name the model and method, got an empty string")
    return user_profiles_dir() / "learned" / f"{host_slug()}--{safe}.json"


class CostLearner:
    """Running averages of measured subgraph costs at chunk length `chunk_len`, starting from `base`.

    `observe(dag, schedule)` folds one real prefill in; `profile()` is the current costs as a Profile;
    `save()` writes them atomically, with their content record, under the folder's lock (two processes
    never interleave a write; the last one's averages win).
    """

    def __init__(self, base: Profile, chunk_len: int, path: Path | None = None, alpha: float = ALPHA):
        if not 0 < alpha <= 1:
            raise ConfigError(f"alpha must be in (0, 1], got {alpha}")
        self.path, self.chunk_len, self.alpha = path, chunk_len, alpha
        if path is not None and path.is_file():
            bad = verify(path.parent, [path.name])  # a cache entry like any other: its content record first
            try:
                if bad:
                    raise ConfigError("; ".join(map(str, bad)))
                base = load_profile(path)
            except ConfigError as e:  # damaged, or a file from an older format: start over from the base
                log.warning("ignoring learned costs %s: %s", path, e)
        self.base, self.n_observed = base, int(base.metadata.get("observed_prefills", 0))
        # (kind, lane) -> {kv_len: µs}; a kind independent of the KV length keeps one point at kv 0
        self.points: dict[tuple[str, str], dict[int, float]] = {}
        # keys measured here: a prior's points (another host's, or an offline run) are dropped at the first
        # observation, so a stale point never bends the interpolation between learned ones
        self.learned: set[tuple[str, str]] = set()
        nearest: dict[tuple[str, str], CostEntry] = {}  # per (kind, lane): its entry at the C nearest chunk_len
        for e in base.costs:  # (a profile may cost one method's kinds at other C than another's, `measure.merged`)
            best = nearest.get((e.kind, e.lane))
            if best is None or (abs(e.chunk_len - chunk_len), e.chunk_len) < (abs(best.chunk_len - chunk_len), best.chunk_len):
                nearest[(e.kind, e.lane)] = e
        for (kind, lane), e in nearest.items():
            self.points[(kind, lane)] = dict(e.points)
            if self.n_observed:
                self.learned.add((kind, lane))

    def observe(self, dag: CompiledDag, schedule: Schedule) -> None:
        """Fold the real durations of one prefill in: per (kind, lane) the median over the layers, per chunk
        for attention at kv_len = (i + 1)·C, the keys `sched.costs.compile_dag` costs it at."""
        if schedule.simulated:
            raise ConfigError("observe takes a real run's schedule, got a simulated one")
        runs: dict[tuple[str, str, int], list[float]] = defaultdict(list)
        for v in range(dag.n_nodes):
            kind, lane = dag.kinds[dag.kind[v]], dag.lanes[dag.lane[v]]
            kv = (dag.chunk[v] + 1) * dag.chunk_len if kind in KV_KINDS else 0
            runs[(kind, lane, kv)].append(schedule.end_us[v] - schedule.start_us[v])
        for (kind, lane, kv), us in runs.items():
            if (kind, lane) not in self.learned:
                self.learned.add((kind, lane))
                self.points[(kind, lane)] = {}
            pts = self.points[(kind, lane)]
            now = statistics.median(us)
            old = pts.get(kv)
            pts[kv] = now if old is None else (1 - self.alpha) * old + self.alpha * now
        self.n_observed += 1

    def profile(self) -> Profile:
        """The current costs: measured on this host, as many prefills as `n_observed` folded in."""
        costs = tuple(CostEntry(kind, lane, self.chunk_len, tuple(sorted(pts.items())))
                      for (kind, lane), pts in sorted(self.points.items()))
        meta = {**dict(self.base.metadata), "observed_prefills": self.n_observed,
                "learned_from": self.base.metadata.get("learned_from", self.base.name)}
        return Profile(name=f"{host_slug()} (learned)", method="measured", simulated=False, costs=costs,
                       layer_subgraphs=self.base.layer_subgraphs, n_layers=self.base.n_layers, metadata=meta)

    def save(self) -> Path | None:
        """Write the learned costs (nothing to write without a path or an observation); None, with the
        one unwritable-cache warning, when the cache cannot take them (read-only, full disk)."""
        if self.path is None or self.n_observed == 0:
            return None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with entry_lock(self.path.parent):
                with atomic_path(self.path) as tmp:
                    tmp.write_text(json.dumps(self.profile().to_dict(), indent=1) + "\n")
                write_record(self.path.parent, [self.path.name])
        except OSError as e:
            cache_unwritable(self.path.parent, e)
            return None
        return self.path
