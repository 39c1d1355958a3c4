"""The INT8 weights and head of a cached model are computed once and read back verified (`outliers.weightcache`)."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from hetero.decode.head import quantize_head
from hetero.outliers import weightcache
from hetero.outliers.plan import _quantize_all, quantize_weights
from tests.conftest import make_tiny_model


@pytest.fixture
def cached_tiny(tmp_path, monkeypatch):
    """A tiny model that has a model cache entry (as a loaded GGUF has), in an empty cache."""
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    m = make_tiny_model(seed=3)
    entry = tmp_path / "models" / m.fingerprint
    entry.mkdir(parents=True)
    (entry / "weights.safetensors").write_bytes(b"the float copy")
    return m, entry


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k].q, b[k].q) and np.array_equal(
        getattr(a[k], "scales", None), getattr(b[k], "scales", None)) for k in a)


def test_weights_are_quantized_once_then_read_back_equal(cached_tiny, monkeypatch):
    m, entry = cached_tiny
    online = {"down_in": 32}
    first = quantize_weights(m, "channel", 127, online)
    assert len(list(entry.glob("int8-*.safetensors"))) == 1
    assert _same(first, dict(_quantize_all(m, "channel", 127, online)))
    monkeypatch.setattr("hetero.outliers.plan._quantize_all", lambda *a: pytest.fail("quantized again"))
    assert _same(quantize_weights(m, "channel", 127, online), first)


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_weights_written_one_linear_at_a_time_are_the_librarys_bytes(cached_tiny, granularity):
    from safetensors.numpy import save_file

    from hetero.tensorfile import map_tensors

    m, entry = cached_tiny
    quantize_weights(m, granularity, 127)
    (path,) = entry.glob("int8-*.safetensors")
    arrays, meta = map_tensors(path)
    save_file({k: np.array(v) for k, v in arrays.items()}, str(entry / "lib.safetensors"), metadata=meta)
    assert path.read_bytes() == (entry / "lib.safetensors").read_bytes()
    assert arrays["0.wq.s"].shape == (() if granularity == "tensor" else (64,))


def test_each_form_has_its_own_file(cached_tiny):
    m, entry = cached_tiny
    a = quantize_weights(m, "channel", 127)
    b = quantize_weights(m, "tensor", 63)
    assert len(list(entry.glob("int8-*.safetensors"))) == 2
    assert not np.array_equal(a[(0, "wq")].q, b[(0, "wq")].q)
    assert isinstance(b[(0, "wq")].scale, float)


def test_edited_weights_under_the_same_fingerprint_never_get_the_old_ones(cached_tiny):
    m, _ = cached_tiny
    before = quantize_weights(m, "channel", 127)
    with torch.no_grad():
        m.weights.layers[0].wq[0, :5] += 1.0  # the head of the tensor: the guard samples it
    after = quantize_weights(m, "channel", 127)
    assert _same(after, dict(_quantize_all(m, "channel", 127, {})))
    assert not np.array_equal(before[(0, "wq")].q, after[(0, "wq")].q)


def test_a_damaged_file_is_recomputed_with_a_warning(cached_tiny, caplog):
    m, entry = cached_tiny
    quantize_weights(m, "channel", 127)
    (path,) = entry.glob("int8-*.safetensors")
    data = bytearray(path.read_bytes())
    data[-10:] = bytes(10)  # damage past the header
    path.write_bytes(bytes(data))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))  # the stamp kept: the content tells
    with caplog.at_level(logging.WARNING):
        again = quantize_weights(m, "channel", 127)
    assert _same(again, dict(_quantize_all(m, "channel", 127, {})))  # (the first weights map the damaged file)
    assert "fails its content hash" in caplog.text and "rebuilding" in caplog.text


def test_a_model_without_a_cache_entry_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    quantize_weights(make_tiny_model(), "channel", 127)
    assert not any(tmp_path.rglob("*.safetensors"))


def test_the_int8_head_is_cached_beside_the_weights(cached_tiny):
    m, entry = cached_tiny
    compute = lambda: dict(zip(("wq", "scale"), quantize_head(m.weights.lm_head)))  # noqa: E731
    first = weightcache.cached_arrays(m, "head-int8", {"qmax": 63}, compute)
    again = weightcache.cached_arrays(m, "head-int8", {"qmax": 63}, lambda: pytest.fail("quantized again"))
    assert np.array_equal(first["wq"], again["wq"]) and np.array_equal(first["scale"], again["scale"])
    assert len(list(entry.glob("head-int8-*.safetensors"))) == 1
