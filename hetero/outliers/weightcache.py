"""Arrays derived from a cached model's weights (its INT8 weights, the INT8 LM head), computed once and kept
beside its cache entry.

Quantizing every linear (and the online Hadamards of rotated sites) took 1.5-4 s a run, and every decode
chunk size did it again. The weights are a pure function of the float weights and the form
(granularity, qmax, online transforms), so they are computed once, written atomically under the entry's
lock with a content record (`paths.cached`), and a warm start only reads them: every plan of that
form, every chunk size and every decode graph share them (mllm-NPU §3.2: weights prepared offline).
Models without a cache entry (built in memory, as the tests' tiny ones) are quantized every time.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from hetero.weights import SITE_LINEARS
from hetero.outliers.quantize import QuantWeight, QuantWeightPerChannel
from hetero.paths import cache_dir, cached
from hetero.tensorfile import LazyTensors, Put, map_tensors, write_tensors

WEIGHTS_VERSION = 1  # bump when quantize_weight(_per_channel) or block_hadamard change what they compute
Weights = dict[tuple[int, str], QuantWeight | QuantWeightPerChannel]


def _float_guard(model) -> str:
    """A cheap digest of the float weights (head and tail of every linear): a model whose weights were edited in
    memory under the same fingerprint never gets another model's INT8 weights. Read through `Model.arrays`:
    a cached model's mapped file, no torch."""
    arrays = model.arrays()
    h = hashlib.sha256()
    names = ["tok_emb", "lm_head"] + [f"layers.{i}.{name}" for i in range(model.config.n_layers)
                                      for names in SITE_LINEARS.values() for name in names]
    for name in names:
        flat = arrays[name].reshape(-1)
        h.update(np.ascontiguousarray(flat[:256]).tobytes())
        h.update(np.ascontiguousarray(flat[-256:]).tobytes())
    return h.hexdigest()[:24]


def _entry(model) -> Path | None:
    """The model's cache folder, once it exists (a cached model's float weights, or a site-rotated model's
    calibration and plans: its float weights are its base model's file, its derived arrays its own); None for a
    model only in memory. What the arrays derive from is checked by content (`_float_guard`)."""
    folder = cache_dir() / "models" / model.fingerprint
    return folder if folder.is_dir() else None


def cached_weights(model, granularity: str, qmax: int, online: dict[str, int],
                   compute: Callable[[], Iterable[tuple[tuple[int, str], QuantWeight | QuantWeightPerChannel]]]
                   ) -> Weights:
    """The INT8 weights of `model` in this form: read from its cache entry (verified), else `compute()`d one linear
    at a time, each written to the entry's file as it comes (`tensorfile.write_tensors`), then mapped."""
    form = {"granularity": granularity, "qmax": int(qmax), "online": sorted([str(k), int(v)] for k, v in online.items())}
    per_tensor = granularity == "tensor"

    def arrays() -> LazyTensors:
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, np.dtype] = {}
        for layer, lw in enumerate(model.weights.layers):
            for name in (n for names in SITE_LINEARS.values() for n in names):
                out, k = getattr(lw, name).shape
                shapes[f"{layer}.{name}.q"], dtypes[f"{layer}.{name}.q"] = (out, k), np.dtype(np.int8)
                # a per-tensor scale is a float64 scalar, per-channel ones float32 (the file's format)
                shapes[f"{layer}.{name}.s"] = () if per_tensor else (out,)
                dtypes[f"{layer}.{name}.s"] = np.dtype(np.float64 if per_tensor else np.float32)

        def pieces(put: Put) -> None:
            for (layer, name), w in compute():
                put(f"{layer}.{name}.q", w.q)
                per_channel = isinstance(w, QuantWeightPerChannel)
                put(f"{layer}.{name}.s", w.scales if per_channel else np.asarray(w.scale, np.float64))

        return LazyTensors(shapes, dtypes=dtypes, pieces=pieces, what="quantize")

    found = cached_arrays(model, "int8", form, arrays)
    weights: Weights = {}
    for key in found:
        if key.endswith(".q"):
            layer, name, _ = key.split(".")
            q, s = found[key], found[f"{layer}.{name}.s"]
            weights[(int(layer), name)] = QuantWeightPerChannel(q, s) if s.ndim else QuantWeight(q, float(s))
    return weights


def cached_arrays(model, kind: str, form: dict, compute: Callable[[], dict[str, np.ndarray] | LazyTensors],
                  source: str | None = None) -> dict[str, np.ndarray]:
    """Named arrays derived from `model`'s float weights (`form` says how), kept as one file of its cache entry
    (`paths.cached`: a content record checked at first use, built once under the entry's lock, a damaged file
    rebuilt with a warning, an unwritable cache computing them again each run). `compute` may give them as
    `LazyTensors`, written a piece at a time and then mapped, so that they are never all in memory at once.
    source: a digest of what they derive from where that is the model's file itself, not its float weights (the
    GGUF's own blocks, `decode.gguf_blocks`): no float weights file is then read, or written to be read."""
    if source is None:
        guard = _float_guard(model)  # reads `model.arrays()` first: a rotated copy's weights file exists from then on
        folder = _entry(model)
    else:
        guard, folder = f"file {source}", cache_dir() / "models" / model.fingerprint
        folder = folder if folder.is_dir() else None
    if folder is None:
        got = compute()
        return got.arrays() if isinstance(got, LazyTensors) else got
    form = {"version": WEIGHTS_VERSION, "kind": kind, **form, "guard": guard}
    text = json.dumps(form, sort_keys=True)
    name = f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.safetensors"

    def load(path: Path) -> dict[str, np.ndarray]:
        arrays, meta = map_tensors(path)  # mapped: safetensors' numpy API copies (85 vs 7 ms)
        if meta.get("form") != text:
            raise ValueError("it was made for another form")
        return arrays

    def save(arrays: dict[str, np.ndarray] | LazyTensors, tmp: Path) -> None:
        if isinstance(arrays, LazyTensors):
            write_tensors(arrays, tmp, {"form": text})
            return
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp), metadata={"form": text})

    got = cached(folder, name, load, compute, save, f"{kind} arrays")
    if isinstance(got, LazyTensors):  # just written: map the file (or, a cache that cannot take it, make them)
        got = cached(folder, name, load, compute, save, f"{kind} arrays")
    return got.arrays() if isinstance(got, LazyTensors) else got
