"""The model cache (`models/<fingerprint>/`): verified on load, rebuilt from the GGUF when damaged or
edited, stale temp files of killed writers removed, unwritable caches survived;
damage behind a kept mtime, non-finite weights and failed loads: a damaged cache is never used."""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
import pytest
import torch

from hetero.errors import ConfigError, ModelFormatError
from hetero.loader import load_model
from hetero.paths import STALE_TEMP_S, cache_dir
from tests.conftest import make_tiny_model
from tests.gguf_writer import write_gguf


@pytest.fixture
def gguf_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    return write_gguf(make_tiny_model(), tmp_path / "tiny.gguf")


def _entry(model):
    return cache_dir() / "models" / model.fingerprint


def _load(path):
    """A model whose float weights are in the entry (written at their first use), not yet mapped: a test that then
    damages the file in place would fault on the mapping."""
    load_model(path).arrays()
    return load_model(path)


def _same(a, b) -> bool:
    return a.config == b.config and all(torch.equal(x.wq, y.wq) and torch.equal(x.w_down, y.w_down)
                                        for x, y in zip(a.weights.layers, b.weights.layers))


def test_flipped_bytes_in_weights_are_detected_and_rebuilt(gguf_path, caplog):
    first = _load(gguf_path)
    w = _entry(first) / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[len(data) // 2: len(data) // 2 + 256] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 256])
    w.write_bytes(bytes(data))  # same size, new stamp: hashed on the next load
    with caplog.at_level(logging.WARNING):
        again = load_model(gguf_path)
        again.weights  # checked at their first use
    assert "damaged" in caplog.text and "content hash" in caplog.text
    assert _same(first, again)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert _same(first, load_model(gguf_path))  # repaired: loads quietly
    assert "damaged" not in caplog.text


def test_edited_meta_is_detected_and_rebuilt(gguf_path, caplog):
    first = load_model(gguf_path)
    meta_file = _entry(first) / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["rope_theta"] = 50000.0
    meta_file.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING):
        again = load_model(gguf_path)
    assert "edited" in caplog.text
    assert again.config.rope_theta == first.config.rope_theta == 10000.0


def test_truncated_weights_are_rebuilt(gguf_path, caplog):
    first = _load(gguf_path)
    w = _entry(first) / "weights.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING):
        assert _same(first, load_model(gguf_path))
    assert "truncated" in caplog.text


def test_stale_temp_files_are_removed_on_rebuild(gguf_path):
    first = load_model(gguf_path)
    entry = _entry(first)
    old, young = entry / ".weights.safetensors.killed.tmp", entry / ".weights.safetensors.live.tmp"
    old.write_bytes(b"x" * 1000), young.write_bytes(b"y")
    t = time.time() - STALE_TEMP_S - 60
    os.utime(old, (t, t))
    (entry / "meta.json").unlink()  # forces a rebuild, which holds the entry's lock
    load_model(gguf_path)
    assert not old.exists() and young.exists()  # a young one may belong to a live writer


def test_unwritable_model_cache_loads_uncached_with_a_warning(gguf_path, caplog):
    cache_dir().mkdir(parents=True, exist_ok=True)
    (cache_dir() / "models").write_text("not a folder")  # nothing can be created under it
    with caplog.at_level(logging.WARNING):
        model = load_model(gguf_path)
    assert "running uncached" in caplog.text
    tiny = make_tiny_model()  # written as F32: read back exactly
    assert all(torch.equal(a.wq, b.wq) for a, b in zip(model.weights.layers, tiny.weights.layers))


def test_cache_folder_that_cannot_be_created_is_a_config_error(monkeypatch):
    monkeypatch.setenv("HETERO_CACHE", "/proc/x")
    with pytest.raises(ConfigError, match="HETERO_CACHE"):
        cache_dir()


def test_nan_weights_behind_a_kept_mtime_are_rebuilt(gguf_path, caplog):
    first = _load(gguf_path)
    w = _entry(first) / "weights.safetensors"
    st = w.stat()
    data = bytearray(w.read_bytes())
    nan = np.full(256, np.nan, np.float32).tobytes()
    data[-len(nan) - 64:-64] = nan  # float data near the end: NaN, same size
    w.write_bytes(bytes(data))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))  # bit rot or a `cp -p` restore keeps the stamp
    with caplog.at_level(logging.WARNING):
        again = load_model(gguf_path)
        again.weights  # checked at their first use
    assert "damaged" in caplog.text and "fails its content hash" in caplog.text
    assert _same(first, again) and all(bool(torch.isfinite(lw.w_down).all()) for lw in again.weights.layers)


def test_non_finite_weights_are_a_model_format_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    bad = make_tiny_model()
    bad.weights.layers[1].w_up[3, 5] = float("inf")
    path = write_gguf(bad, tmp_path / "inf.gguf")
    with pytest.raises(ModelFormatError, match="layer 1 w_up holds NaN or infinite values"):
        load_model(path).arrays()  # checked as they are first read


def test_a_failed_load_leaves_nothing_behind(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HETERO_CACHE", str(cache))
    bad = make_tiny_model()
    bad.weights.layers[0].wq[0, 0] = float("nan")
    for path in (write_gguf(bad, tmp_path / "nan.gguf"), tmp_path / "cut.gguf"):
        if path.name == "cut.gguf":
            path.write_bytes((tmp_path / "nan.gguf").read_bytes()[:4000])  # a truncated GGUF
        with pytest.raises(ModelFormatError):
            load_model(path).arrays()
    # the weights are dequantized into the entry's file under its lock: the lock file stays (as every cache entry's
    # does, in models/.locks/), nothing else
    left = [q for q in cache.rglob("*") if ".locks" not in q.parts and q != cache / "models"] if cache.exists() else []
    assert not left


def test_rotation_reads_the_gguf_itself_and_the_float_weights_are_written_at_their_first_use(gguf_path):
    """A cold load keeps no float32 copy; rotation reads the GGUF and makes the bytes it makes from the kept float
    weights; the float weights are written (and recorded first in meta.json) only when something reads them."""
    from hetero.loader import FloatTensors
    from hetero.outliers.rotate import rotated_tensors

    model = load_model(gguf_path)
    entry = _entry(model)
    assert not (entry / "weights.safetensors").exists()
    from_gguf = rotated_tensors(model.config, model.float_tensors(), 3).arrays()
    assert not (entry / "weights.safetensors").exists()
    kept = FloatTensors.of(model.arrays())
    assert (entry / "weights.safetensors").is_file()
    assert next(iter(json.loads((entry / "meta.json").read_text())["files"])) == "weights.safetensors"
    from_kept = rotated_tensors(model.config, kept, 3).arrays()
    assert from_gguf.keys() == from_kept.keys()
    assert all(np.array_equal(from_gguf[k], from_kept[k]) for k in from_gguf)
    assert _same(model, _load(gguf_path))  # a warm load maps the written file


def test_rotating_a_gguf_with_a_non_finite_weight_is_a_model_format_error(tmp_path, monkeypatch, caplog):
    from hetero.outliers.rotate import rotate_model

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    bad = make_tiny_model()
    bad.weights.layers[1].w_up[3, 5] = float("inf")
    model = load_model(write_gguf(bad, tmp_path / "inf.gguf"))
    with caplog.at_level(logging.WARNING), pytest.raises(ModelFormatError, match="layer 1 w_up"):
        rotate_model(model).arrays()
    assert "uncached" not in caplog.text  # a weight refused, not a cache that cannot be written
    assert not (cache_dir() / "models" / f"{model.fingerprint}-rot1s0").exists()
