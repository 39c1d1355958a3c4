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


def _same(a, b) -> bool:
    return a.config == b.config and all(torch.equal(x.wq, y.wq) and torch.equal(x.w_down, y.w_down)
                                        for x, y in zip(a.weights.layers, b.weights.layers))


def test_flipped_bytes_in_weights_are_detected_and_rebuilt(gguf_path, caplog):
    first = load_model(gguf_path)
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
    first = load_model(gguf_path)
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
    first = load_model(gguf_path)
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
        load_model(path)


def test_a_failed_load_leaves_nothing_behind(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HETERO_CACHE", str(cache))
    bad = make_tiny_model()
    bad.weights.layers[0].wq[0, 0] = float("nan")
    for path in (write_gguf(bad, tmp_path / "nan.gguf"), tmp_path / "cut.gguf"):
        if path.name == "cut.gguf":
            path.write_bytes((tmp_path / "nan.gguf").read_bytes()[:4000])  # a truncated GGUF
        with pytest.raises(ModelFormatError):
            load_model(path)
    # the weights are dequantized into the entry's file under its lock: the lock file stays (as every cache entry's
    # does, in models/.locks/), nothing else
    left = [q for q in cache.rglob("*") if ".locks" not in q.parts and q != cache / "models"] if cache.exists() else []
    assert not left
