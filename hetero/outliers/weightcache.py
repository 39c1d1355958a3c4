"""Arrays derived from a cached model's weights (its INT8 weights, the INT8 LM head), computed once and kept
beside its cache entry.

Quantizing every linear (and the online Hadamards of rotated sites) took 1.5-4 s a run, and every decode
chunk size did it again (issue 28). The weights are a pure function of the float weights and the form
(granularity, qmax, online transforms), so they are computed once, written atomically under the entry's
lock with a content record (`paths.file_record`), and a warm start only reads them: every plan of that
form, every chunk size and every decode graph share them (mllm-NPU §3.2: weights prepared offline).
Models without a cache entry (built in memory, as the tests' tiny ones) are quantized every time.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
from filelock import FileLock

from hetero.model import SITE_LINEARS
from hetero.outliers.quantize import QuantWeight, QuantWeightPerChannel
from hetero.paths import atomic_path, cache_dir, check_files, file_record

log = logging.getLogger(__name__)

WEIGHTS_VERSION = 1  # bump when quantize_weight(_per_channel) or block_hadamard change what they compute
Weights = dict[tuple[int, str], QuantWeight | QuantWeightPerChannel]


def _float_guard(model) -> str:
    """A cheap digest of the float weights (head and tail of every linear): a model whose weights were edited in
    memory under the same fingerprint never gets another model's INT8 weights."""
    h = hashlib.sha256()
    for t in (model.weights.tok_emb, model.weights.lm_head):
        flat = t.detach().reshape(-1)
        h.update(flat[:256].cpu().numpy().tobytes())
        h.update(flat[-256:].cpu().numpy().tobytes())
    for lw in model.weights.layers:
        for names in SITE_LINEARS.values():
            for name in names:
                flat = getattr(lw, name).detach().reshape(-1)
                h.update(flat[:256].cpu().numpy().tobytes())
                h.update(flat[-256:].cpu().numpy().tobytes())
    return h.hexdigest()[:24]


def _entry(model) -> Path | None:
    folder = cache_dir() / "models" / model.fingerprint
    return folder if (folder / "weights.safetensors").is_file() else None


def cached_weights(model, granularity: str, qmax: int, online: dict[str, int], compute: Callable[[], Weights]) -> Weights:
    """The INT8 weights of `model` in this form: read from its cache entry (verified), else `compute()`d and saved."""
    form = {"granularity": granularity, "qmax": int(qmax), "online": sorted([str(k), int(v)] for k, v in online.items())}

    def arrays() -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for (layer, name), w in compute().items():
            out[f"{layer}.{name}.q"] = w.q
            out[f"{layer}.{name}.s"] = w.scales if isinstance(w, QuantWeightPerChannel) else np.asarray(w.scale, np.float64)
        return out

    found = cached_arrays(model, "int8", form, arrays)
    weights: Weights = {}
    for key in found:
        if key.endswith(".q"):
            layer, name, _ = key.split(".")
            q, s = found[key], found[f"{layer}.{name}.s"]
            weights[(int(layer), name)] = QuantWeightPerChannel(q, s) if s.ndim else QuantWeight(q, float(s))
    return weights


def cached_arrays(model, kind: str, form: dict, compute: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Named arrays derived from `model`'s float weights (what `form` says how), read from its cache entry when a
    verified copy exists, else `compute()`d and written there (atomically, under a lock, with a content record).

    A damaged or foreign file is recomputed with a warning; a cache that cannot be written keeps them in memory."""
    folder = _entry(model)
    if folder is None:
        return compute()
    form = {"version": WEIGHTS_VERSION, "kind": kind, **form, "guard": _float_guard(model)}
    key = hashlib.sha256(json.dumps(form, sort_keys=True).encode()).hexdigest()[:16]
    path = folder / f"{kind}-{key}.safetensors"
    found = _read(path, form, repair=False)
    if found is not None:
        return found
    arrays: dict[str, np.ndarray] | None = None
    try:
        with FileLock(str(folder / f".{kind}-{key}.lock"), timeout=900):
            found = _read(path, form, repair=True)  # another process may have written it meanwhile
            if found is not None:
                return found
            arrays = compute()
            _write(path, form, arrays)
    except OSError as e:  # a read-only or full cache: the arrays stay in memory for this run
        log.warning("cannot cache %s arrays in %s (%s); computing them again next run", kind, folder, e.strerror or e)
    return arrays if arrays is not None else compute()


def _record_path(path: Path) -> Path:
    return path.with_suffix(".json")


def _read(path: Path, form: dict, repair: bool) -> dict[str, np.ndarray] | None:
    rec_path = _record_path(path)
    if not (path.is_file() and rec_path.is_file()):
        return None
    try:
        rec = json.loads(rec_path.read_text())
        if rec.get("form") != form:
            raise ValueError("its record is for another form")
        why, _ = check_files(path.parent, {path.name: rec["file"]})
        if why is not None:
            raise ValueError(why)
        from safetensors.numpy import load_file

        return load_file(str(path))
    except Exception as e:  # anything unexpected in a cache file: recompute, never trust it
        if repair:
            log.warning("cache file %s is damaged (%s); computing it again", path, e)
            path.unlink(missing_ok=True)
            rec_path.unlink(missing_ok=True)
        return None


def _write(path: Path, form: dict, arrays: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    with atomic_path(path) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp))
    with atomic_path(_record_path(path)) as tmp:
        tmp.write_text(json.dumps({"form": form, "file": file_record(path)}))
