"""Measure a device profile: the latency of every subgraph kind on every lane (mllm-NPU §3.4, §3.2).

`measure_profile` times callables (median of `repeats` after `warmup` calls) over chunk lengths C and,
for attention, KV lengths; it knows nothing about models. `hetero profile` passes callables that run
the real prebuilt subgraphs.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import platform
import socket
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from hetero.errors import ConfigError
from hetero.nodes import DEFAULT_PLACEMENT
from hetero.paths import profile_search_path, user_profiles_dir
from hetero.sched.profile import KINDS, CostEntry, Profile, load_profile
from hetero.timing import median_seconds

log = logging.getLogger(__name__)

CHUNK_LENS = (32, 64, 128, 256, 512)
KV_LENS = (256, 512, 1024, 2048, 4096)
KV_KINDS = ("attn", "layer", "layer_attn")  # kinds whose cost depends on the KV length: those holding the attention

class NotMeasured(Exception):
    """Raised by a `run_subgraph` callable for a (kind, lane, C) it does not run: that entry is skipped."""

RunSubgraph = Callable[[str, str, int, int], None]  # (kind, lane, C, kv_len) -> None, runs it once


def measure_profile(run_subgraph: RunSubgraph, kinds: Sequence[str], lanes: Sequence[str],
                    chunk_lens: Sequence[int] = CHUNK_LENS, kv_lens: Sequence[int] = KV_LENS,
                    repeats: int = 5, warmup: int = 1, *, name: str, n_layers: int,
                    layer_subgraphs: Sequence[tuple[str, str]] = DEFAULT_PLACEMENT,
                    metadata: Mapping[str, Any] | None = None, log: Callable[[str], None] | None = None) -> Profile:
    """Time `run_subgraph(kind, lane, C, kv_len)` for every kind × lane × C (× kv_len for attention).

    A (kind, lane) pair the callable does not run there raises `NotMeasured` and is skipped.
    Attention is timed at kv_len in `kv_lens` that are >= C (and at kv_len = C): a chunk attends over
    at least itself. The cost is the median of `repeats` timed calls after `warmup` untimed ones.
    """
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    costs: list[CostEntry] = []
    for kind in kinds:
        for lane in lanes:
            for c in chunk_lens:
                kvs = sorted({c, *(kv for kv in kv_lens if kv >= c)}) if kind in KV_KINDS else [0]
                points = []
                try:
                    for kv in kvs:
                        points.append((kv, _median_us(run_subgraph, kind, lane, c, kv, repeats, warmup)))
                except NotMeasured:
                    break
                costs.append(CostEntry(kind, lane, c, tuple(points)))
                if log is not None:
                    log(f"{kind:7s} {lane:4s} C={c:4d} " + " ".join(f"kv{kv}={us:.0f}us" for kv, us in points))
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "method_detail": f"median of {repeats} timed runs after {warmup} warm-up run(s), time.perf_counter",
            **host_metadata(), **dict(metadata or {})}
    return Profile(name=name, method="measured", simulated=False, costs=tuple(costs),
                   layer_subgraphs=tuple(tuple(x) for x in layer_subgraphs), n_layers=n_layers, metadata=meta)


def _median_us(fn: RunSubgraph, kind: str, lane: str, c: int, kv: int, repeats: int, warmup: int) -> float:
    return 1e6 * median_seconds(lambda: fn(kind, lane, c, kv), repeats, warmup)


def _cpu_name() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def host_metadata() -> dict[str, Any]:
    """device and versions of this host, for a measured profile. Versions come from the installed packages'
    metadata, not by importing them (importing torch alone costs ~0.9 s, and a warm `hetero run` never does)."""
    import os
    import sys
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": platform.python_version()}
    for mod in ("numpy", "torch", "onnxruntime"):
        try:  # a loaded module knows its version (e.g. onnxruntime installed as onnxruntime-openvino)
            versions[mod] = sys.modules[mod].__version__ if mod in sys.modules else version(mod)
        except PackageNotFoundError:
            pass
    return {"device": f"{_cpu_name()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.machine()}",
            "host": socket.gethostname(), "versions": versions}


def host_slug() -> str:
    """File stem for this host's profile, e.g. ``vm-amd-epyc-2c`` (profiles/<host>.json); cheap (on the decode
    path: `decode.stepcosts` names its cache file with it)."""
    import os
    import re

    cpu = _cpu_name()
    slug = re.sub(r"[^a-z0-9]+", "-", f"{socket.gethostname()}-{cpu}".lower()).strip("-")
    return f"{slug}-{os.cpu_count()}c"


def profile_command(out_path: str | None, run_subgraph: RunSubgraph, *,
                    kinds: Sequence[str] = KINDS, lanes: Sequence[str] = ("npu", "cpu"),
                    chunk_lens: Sequence[int] = CHUNK_LENS, kv_lens: Sequence[int] = KV_LENS, repeats: int = 5,
                    n_layers: int = 30, layer_subgraphs: Sequence[tuple[str, str]] = DEFAULT_PLACEMENT,
                    metadata: Mapping[str, Any] | None = None, log: Callable[[str], None] | None = print) -> Profile:
    """`hetero profile`: measure and write ``<cache>/profiles/<host>.json`` (or `out_path`), keeping the costs there
    that it did not measure (`merged`); returns the Profile written."""
    from hetero.sched.profile import save_profile

    meta = dict(metadata or {})
    name = Path(out_path).stem if out_path else host_slug()
    prof = measure_profile(run_subgraph, kinds, lanes, chunk_lens, kv_lens, repeats, name=name, n_layers=n_layers,
                           layer_subgraphs=layer_subgraphs, metadata=meta, log=log)
    if not prof.costs:  # nothing measured: the file there stays as it is
        raise ConfigError(f"none of the subgraph kinds {list(kinds)} ran on the lanes {list(lanes)}: nothing to write")
    out = Path(out_path) if out_path else user_profiles_dir() / f"{name}.json"
    prof = merged(prof, out, log)
    save_profile(prof, out)
    if log is not None:
        log(f"wrote {out}")
    return prof


def merged(new: Profile, path: Path, log: Callable[[str], None] | None = None) -> Profile:
    """`new` with the costs of the profile at `path` that it did not measure, when that file profiles the same model:
    profiling one method keeps another method's costs (profiling the default's whole-layer graphs left
    no cost for `hetero-lanes`' qkv/attn/o_ffn). The placement it records stays a scheduler's (`KINDS`)."""
    try:
        old = load_profile(path) if path.is_file() else None
    except ConfigError as e:
        old = None
        if log is not None:
            log(f"replacing {path}: {e}")
    model = new.metadata.get("model", {}).get("fingerprint")
    if old is None or old.metadata.get("model", {}).get("fingerprint") != model or old.n_layers != new.n_layers:
        return new
    measured = {(e.kind, e.lane, e.chunk_len) for e in new.costs}
    kept = tuple(e for e in old.costs if (e.kind, e.lane, e.chunk_len) not in measured)
    if not kept:
        return new
    if log is not None:
        log(f"kept {len(kept)} costs of {path} that this run did not measure "
            f"({', '.join(sorted({e.kind for e in kept}))})")
    placement = new.layer_subgraphs if all(k in KINDS for k, _ in new.layer_subgraphs) else old.layer_subgraphs
    return dataclasses.replace(new, costs=new.costs + kept, layer_subgraphs=placement)


def host_profile(placement: Sequence[tuple[str, str]] = ()) -> Profile:
    """This host's measured profile (`<host>.json`: the user's, else a shipped one), else any measured
    profile (`paths.profile_search_path`), else a derived one. placement: the (kind, lane) pairs it must cost; a
    profile without them (another method's subgraphs) is passed over with a warning, never run into."""
    folders = profile_search_path()
    own = [d / f"{host_slug()}.json" for d in folders]
    mine = next((p for p in own if p.is_file()), None)
    paths = ([mine] if mine is not None else []) + [p for d in folders for p in sorted(d.glob("*.json")) if p != mine]
    loaded: dict[Path, Profile | None] = {}

    def load(path: Path) -> Profile | None:
        if path not in loaded:
            try:
                loaded[path] = load_profile(path)
            except Exception:
                if path == mine:
                    raise
                loaded[path] = None  # not a sched profile (e.g. an equivalent-shapes table)
        return loaded[path]

    passed: list[str] = []
    for want in ("this host's", "measured", "derived"):
        for path in paths:
            p = load(path) if (path == mine) == (want == "this host's") else None
            if p is None or (want != "this host's" and p.method != want):
                continue
            missing = sorted({(k, lane) for k, lane in placement if not any(p.has(k, lane, c) for c in p.chunk_lens)})
            if missing:
                passed.append(f"{path} has no cost for {missing}")
                continue
            if passed:
                log.warning("%s: dispatching on the costs of %s (`hetero profile --method METHOD` measures a method's)",
                            "; ".join(passed), path.name)
            elif path != mine:
                log.info("no profile for this host; dispatching on the costs of %s", path.name)
            return p
    raise ConfigError(f"no profile in {' or '.join(map(str, folders))} costs {list(placement)}: run `hetero profile` first")
