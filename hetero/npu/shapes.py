"""Equivalent shapes (mllm-NPU §4, optimisation 1): [C, K] vs [a, C/a, K] vs a 1×1 Conv2d, per provider and C.

`profile_shapes` times each candidate graph of one layer and records the winner per (provider, kind, C) in
`<cache>/profiles/shapes/equivalent_shapes_<host>.json` (else the shipped `hetero/profiles/shapes/` is read);
`NpuBackend(..., options=GraphOptions(shape="auto"))` reads it (`recorded_shape`). A "simulated" entry (HTP simulator) says nothing
about a device's speed. Format: docs/design.md.
"""

from __future__ import annotations

import functools
import json
import math
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hetero.errors import GraphCacheError
from hetero.npu import segments
from hetero.npu.providers import prepare_graph
from hetero.paths import PROFILES_DIR, atomic_path, user_profiles_dir

SHAPES_VERSION = 1


def shapes_path(host: str | None = None, shipped: bool = False) -> Path:
    """This host's table of equivalent shapes: measured by the user (`user_profiles_dir()`, where
    `hetero npu shapes` writes), or `shipped` with the package (read-only)."""
    folder = PROFILES_DIR if shipped else user_profiles_dir()
    return folder / "shapes" / f"equivalent_shapes_{host or socket.gethostname()}.json"


def candidates(chunk: int) -> list[str]:
    """'2d'; '3d:a' for a near √C and its neighbouring divisors (square-ish first, as §4 suggests); the
    1×1 Conv2d over a 1×C row ('conv:1') and over the squarest a×C/a image."""
    divs = [a for a in range(2, chunk) if chunk % a == 0]
    divs.sort(key=lambda a: abs(math.log(a / math.sqrt(chunk))))
    return ["2d"] + [f"3d:{a}" for a in divs[:3]] + ["conv:1"] + [f"conv:{a}" for a in divs[:1]]


def _interleaved_medians_us(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median µs of each fn, timed round-robin (one call of each per round after a warm-up round), so
    that drift of a shared machine hits every candidate alike."""
    for fn in fns.values():
        fn()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            ts[k].append((time.perf_counter() - t) * 1e6)
    return {k: round(statistics.median(v), 1) for k, v in ts.items()}


BUILD_BUDGET = 10.0  # a candidate may take at most this many times the build time of [C, K] to win


def pick_winner(latency_us: dict[str, float], build_s: dict[str, float]) -> str:
    """The fastest candidate, among those whose one-time build costs at most BUILD_BUDGET × that of "2d"
    (where both were built now): the first run pays for the build (§2.3), and on the generic HTP
    simulator conv:1 runs 1.3x faster but takes ~30 s a graph to finalize, ~40 min for the model."""
    ok = {k: v for k, v in latency_us.items()
          if "2d" not in build_s or k not in build_s or build_s[k] <= BUILD_BUDGET * build_s["2d"]}
    return min(ok, key=ok.get) if ok else "2d"


def provider_is_simulated(provider) -> bool:
    """The QNN HTP provider off an ARM/Hexagon host is the x86-64 simulator of the onnxruntime-qnn wheel."""
    import platform

    return provider.flavor.startswith("qnn") and platform.machine().lower() in ("x86_64", "amd64")


def profile_shapes(model, plan, chunks, provider, layer: int = 0, repeats: int = 9, path: Path | None = None,
                   use_cache: bool = True) -> dict:
    """Time every candidate shape of `qkv` and `o_ffn` (no-shadow segments) on `provider`; write the table.

    A candidate the provider cannot build (e.g. a shape the HTP simulator fails to finalize) is recorded
    under "failed" with the reason and never wins.
    """
    cfg = model.config
    lq = segments.layer_q(cfg, model.arrays(), plan, layer)
    rng = np.random.default_rng(0)
    entries = []
    for c in chunks:
        for spec0 in segments.layer_segments(layer, set(), c, provider.flavor):
            runs, failed, build_s = {}, {}, {}
            for shape in candidates(c):
                spec = segments.SegmentSpec(layer, spec0.kind, spec0.pieces, c, provider.flavor, shape)
                try:
                    g, info = prepare_graph(spec, lq, model.fingerprint, provider, use_cache)
                except GraphCacheError as e:
                    failed[shape] = str(e)[-300:]
                    continue
                if not info.cached:
                    build_s[shape] = round(info.seconds, 3)
                ins = {n: rng.standard_normal((c, w), dtype=np.float32) for n, w in g.inputs.items()}
                runs[shape] = functools.partial(g.run, ins)
            lat = _interleaved_medians_us(runs, repeats) if runs else {}
            entry = {"provider": provider.name, "kind": spec0.kind, "chunk_len": c, "winner": pick_winner(lat, build_s),
                     "latency_us": lat, "build_s": build_s, "simulated": provider_is_simulated(provider), "repeats": repeats}
            if failed:
                entry["failed"] = failed
            entries.append(entry)
    path = path or shapes_path()
    old = json.loads(path.read_text()) if path.exists() else {"entries": []}
    keep = [e for e in old.get("entries", [])
            if not any((e["provider"], e["kind"], e["chunk_len"]) == (n["provider"], n["kind"], n["chunk_len"]) for n in entries)]
    table = {"version": SHAPES_VERSION, "host": socket.gethostname(), "model": model.name,
             "entries": keep + entries}
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(table, indent=1))
    return table


@functools.lru_cache(maxsize=8)
def _read_table(path: str, mtime_ns: int) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def recorded_shape(provider_name: str, kind: str, chunk: int, path: Path | None = None) -> str:
    """The recorded winner for (provider, kind, C); '2d' when none is recorded. Cut segments use o_ffn's."""
    path = path or next((p for p in (shapes_path(), shapes_path(shipped=True)) if p.exists()), None)
    if path is None or not path.exists():
        return "2d"
    table = _read_table(str(path), path.stat().st_mtime_ns)  # read once per version of the file
    kind = "qkv" if kind == "qkv" else "o_ffn"
    for e in table.get("entries", []):
        if (e["provider"], e["kind"], e["chunk_len"]) == (provider_name, kind, chunk):
            return e["winner"]
    return "2d"
