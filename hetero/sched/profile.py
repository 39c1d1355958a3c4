"""Device profiles: the measured (or derived) cost of every subgraph kind on every lane (mllm-NPU §3.4).

A cost is stored per (kind, lane, C) as points (kv_len, latency_us): one point for static kinds, several
for `attn`, interpolated linearly (affine in kv_len for fixed C). JSON, `version` 1, with the placement
profiled (`layer_subgraphs`) and the costs; format in docs/design.md, "Scheduler".
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from hetero.dag import LANES
from hetero.errors import ConfigError
from hetero.nodes import DEFAULT_PLACEMENT, SUBGRAPH_KINDS, NodeKind
from hetero.nodes import KINDS as LAYER_KINDS  # (this module's KINDS: what a profile may cost)

PROFILE_VERSION = 1
KINDS = (*SUBGRAPH_KINDS, "shadow")  # kinds a profile may cost: a layer's, and the CPU side of Eq. 1
# the DAG node kinds of a profiled placement: the generic layer's, and the shadow correction as a node of its own
NODE_KINDS = {**LAYER_KINDS, "shadow": NodeKind("shadow")}
METHODS = ("measured", "derived")


@dataclass(frozen=True, slots=True)
class CostEntry:
    """Latency of one subgraph kind on one lane at chunk length C, as points (kv_len, us)."""

    kind: str
    lane: str
    chunk_len: int  # C
    points: tuple[tuple[int, float], ...]  # sorted by kv_len; one point: independent of kv_len

    def __post_init__(self) -> None:
        if not self.points:
            raise ConfigError(f"cost entry {self.kind}/{self.lane}/C={self.chunk_len}: expected >= 1 point, got none")
        if any(us < 0 for _, us in self.points):
            raise ConfigError(f"cost entry {self.kind}/{self.lane}/C={self.chunk_len}: negative latency {self.points}")
        kvs = [kv for kv, _ in self.points]
        if kvs != sorted(set(kvs)):
            raise ConfigError(f"cost entry {self.kind}/{self.lane}/C={self.chunk_len}: kv_lens must increase, got {kvs}")

    def at(self, kv_len: int) -> float:
        """Latency in µs at `kv_len` keys: piecewise-linear through the points, clamped at 0."""
        pts = self.points
        if len(pts) == 1:
            return pts[0][1]
        k = bisect.bisect_left(pts, (kv_len, float("-inf")))
        k = min(max(k, 1), len(pts) - 1)  # the segment [k-1, k], also past either end
        (x0, y0), (x1, y1) = pts[k - 1], pts[k]
        return max(0.0, y0 + (y1 - y0) * (kv_len - x0) / (x1 - x0))


@dataclass(frozen=True, slots=True)
class Profile:
    """Subgraph latencies of one model on one device (mllm-NPU §3.4, "profiles ... offline").

    Hashable (metadata is excluded from eq/hash), so compiled DAGs can be cached per profile.
    """

    name: str
    method: str  # "measured" | "derived"
    simulated: bool  # True when no run on the named device produced these numbers
    costs: tuple[CostEntry, ...]
    layer_subgraphs: tuple[tuple[str, str], ...] = DEFAULT_PLACEMENT  # the placement profiled
    n_layers: int = 1  # decoder layers of the profiled model
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"profile {self.name!r}: method must be one of {METHODS}, got {self.method!r}")
        if self.n_layers <= 0:
            raise ConfigError(f"profile {self.name!r}: n_layers must be > 0, got {self.n_layers}")
        for kind, lane in self.layer_subgraphs:
            if lane not in LANES:
                raise ConfigError(f"profile {self.name!r}: lane must be one of {LANES}, got {lane!r} for {kind!r}")
        for e in self.costs:
            key = (e.kind, e.lane, e.chunk_len)
            if key in self._index:
                raise ConfigError(f"profile {self.name!r}: duplicate cost entry {key}")
            self._index[key] = e

    @property
    def chunk_lens(self) -> tuple[int, ...]:
        return tuple(sorted({e.chunk_len for e in self.costs}))

    @property
    def lanes(self) -> tuple[str, ...]:
        present = {e.lane for e in self.costs}
        return tuple(lane for lane in LANES if lane in present)

    def has(self, kind: str, lane: str, chunk_len: int) -> bool:
        return (kind, lane, chunk_len) in self._index

    def cost_us(self, kind: str, lane: str, chunk_len: int, kv_len: int = 0) -> float:
        """Latency in µs of subgraph `kind` on `lane` for a chunk of `chunk_len` tokens over `kv_len` keys."""
        entry = self._index.get((kind, lane, chunk_len))
        if entry is None:
            have = sorted(k for k in self._index if k[0] == kind)
            raise ConfigError(
                f"profile {self.name!r} has no cost for kind={kind!r} lane={lane!r} C={chunk_len}; "
                f"it has {have or 'no entry of that kind'}"
            )
        return entry.at(kv_len)

    # ---- disk -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"version": PROFILE_VERSION, "name": self.name, "method": self.method,
                             "simulated": self.simulated}
        d.update({k: v for k, v in self.metadata.items() if k not in d})
        d["model"] = {**dict(self.metadata.get("model", {})), "n_layers": self.n_layers}
        d["layer_subgraphs"] = [list(x) for x in self.layer_subgraphs]
        d["costs"] = [{"kind": e.kind, "lane": e.lane, "chunk_len": e.chunk_len,
                       "points": [[kv, round(us, 3)] for kv, us in e.points]} for e in self.costs]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Profile":
        if d.get("version") != PROFILE_VERSION:
            raise ConfigError(f"profile version must be {PROFILE_VERSION}, got {d.get('version')!r}")
        try:
            costs = tuple(
                CostEntry(c["kind"], c["lane"], int(c["chunk_len"]),
                          tuple((int(kv), float(us)) for kv, us in c["points"]))
                for c in d["costs"]
            )
            model = dict(d.get("model", {}))
            reserved = {"version", "name", "method", "simulated", "costs", "layer_subgraphs"}
            meta = {k: v for k, v in d.items() if k not in reserved}
            return cls(
                name=str(d["name"]), method=str(d["method"]), simulated=bool(d.get("simulated", False)),
                costs=costs, layer_subgraphs=tuple((str(k), str(ln)) for k, ln in d["layer_subgraphs"]),
                n_layers=int(model.get("n_layers", 1)), metadata=meta,
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"profile {d.get('name', '?')!r} is malformed: {e!r}") from e


def load_profile(path: str | os.PathLike) -> Profile:
    """Read a profile JSON written by `save_profile` (or by hand, same schema)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"profile file {str(path)!r} does not exist") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"profile file {str(path)!r} is not valid JSON: {e}") from e
    return Profile.from_dict(data)


def save_profile(profile: Profile, path: str | os.PathLike) -> Path:
    """Write `profile` as JSON atomically (temp file beside the target, then `os.replace`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(profile.to_dict(), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path

