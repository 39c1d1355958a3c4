"""Equivalent shapes (mllm-NPU §4, optimisation 1): profile [C, K] vs [a, C/a, K] per lane and C, keep the winner.

A linear over [C, K] gives the same result on [a, b, K] with a·b = C (every op of a static subgraph is
row-wise); NPUs often prefer some shapes (the paper: 32×32×2048 is 1.62× faster than 1024×1×2048).
`profile_shapes` times each candidate graph of one layer and records, per (lane, kind, C), the winner
in `profiles/shapes/equivalent_shapes_<host>.json`; `NpuBackend(shape="auto")` reads it (`recorded_shape`).
The 1×1 Conv2d candidate is not profiled yet (`constraints.QNN_NOT_YET`).

JSON (version 1): {"version": 1, "host": ..., "entries": [{"lane", "kind", "chunk_len", "winner",
"latency_us": {shape: us}}]}
"""

from __future__ import annotations

import json
import math
import socket
import statistics
import time
from pathlib import Path

import torch

from hetero.npu import export
from hetero.npu.lanes import prepare_graph
from hetero.paths import PROFILES_DIR, atomic_path

SHAPES_VERSION = 1


def shapes_path(host: str | None = None) -> Path:
    return PROFILES_DIR / "shapes" / f"equivalent_shapes_{host or socket.gethostname()}.json"


def candidates(chunk: int) -> list[str]:
    """'2d' and '3d:a' for a near √C and its neighbouring divisors (square-ish first, as §4 suggests)."""
    divs = [a for a in range(2, chunk) if chunk % a == 0]
    divs.sort(key=lambda a: abs(math.log(a / math.sqrt(chunk))))
    return ["2d"] + [f"3d:{a}" for a in divs[:3]]


def _median_us(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    return statistics.median(ts)


def profile_shapes(model, plan, chunks, lane, layer: int = 0, repeats: int = 5, path: Path | None = None,
                   use_cache: bool = True) -> dict:
    """Time every candidate shape of `qkv` and `o_ffn` (no-shadow segments) on `lane`; write the table."""
    cfg = model.config
    lq = export.layer_q(cfg, model.weights.layers[layer], plan, layer)
    entries = []
    for c in chunks:
        for spec0 in export.layer_segments(layer, set(), c, lane.flavor):
            lat = {}
            for shape in candidates(c):
                spec = export.SegmentSpec(layer, spec0.kind, spec0.pieces, c, lane.flavor, shape)
                g, _ = prepare_graph(spec, lq, model.fingerprint, lane, use_cache)
                ins = {n: torch.randn(c, w) for n, w in g.inputs.items()}
                lat[shape] = round(_median_us(lambda: g.run(ins), repeats), 1)
            entries.append({"lane": lane.name, "kind": spec0.kind, "chunk_len": c,
                            "winner": min(lat, key=lat.get), "latency_us": lat})
    path = path or shapes_path()
    old = json.loads(path.read_text()) if path.exists() else {"entries": []}
    keep = [e for e in old.get("entries", [])
            if not any((e["lane"], e["kind"], e["chunk_len"]) == (n["lane"], n["kind"], n["chunk_len"]) for n in entries)]
    table = {"version": SHAPES_VERSION, "host": socket.gethostname(), "model": model.name,
             "entries": keep + entries}
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(table, indent=1))
    return table


def recorded_shape(lane_name: str, kind: str, chunk: int, path: Path | None = None) -> str:
    """The recorded winner for (lane, kind, C); '2d' when none is recorded. Cut segments use o_ffn's."""
    path = path or shapes_path()
    if not path.exists():
        return "2d"
    try:
        table = json.loads(path.read_text())
    except ValueError:
        return "2d"
    kind = "qkv" if kind == "qkv" else "o_ffn"
    for e in table.get("entries", []):
        if (e["lane"], e["kind"], e["chunk_len"]) == (lane_name, kind, chunk):
            return e["winner"]
    return "2d"
