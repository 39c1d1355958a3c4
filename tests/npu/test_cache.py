"""The prebuilt-graph cache: hit, stale and corrupt entries rebuilt with a warning."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from hetero.errors import GraphCacheError
from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.npu.cache import CacheEntry, cache_usage, clear_cache, graphs_root
from tests.npu.conftest import tiny_plan


def _entries(backend="ort-cpu"):
    return sorted((graphs_root() / backend).iterdir())


def test_second_prepare_loads_from_cache(tiny):
    plan = tiny_plan(tiny)
    first = NpuBackend(tiny, plan, 16)
    assert not any(r[3] for r in first.report.rows) and len(first.report.rows) == 4
    second = NpuBackend(tiny, plan, 16)
    assert second.report.all_cached
    h = np.random.default_rng(0).standard_normal((16, 64), dtype=np.float32)
    np.testing.assert_array_equal(first.qkv(0, h)[0], second.qkv(0, h)[0])


def test_key_changes_with_chunk_and_plan(tiny):
    NpuBackend(tiny, tiny_plan(tiny), 16, options=GraphOptions(dynamic_rows=False))
    assert not NpuBackend(tiny, tiny_plan(tiny), 32, options=GraphOptions(dynamic_rows=False)).report.all_cached
    assert not NpuBackend(tiny, tiny_plan(tiny, scale=0.05), 16,
                          options=GraphOptions(dynamic_rows=False)).report.all_cached
    assert len(_entries()) == 12


def test_dynamic_rows_graphs_serve_every_chunk_length(tiny):
    first = NpuBackend(tiny, tiny_plan(tiny), 16)
    assert first.any_rows and {r.graph.spec.chunk for layer in first.layers for r in first.program(layer).runs} == {0}
    second = NpuBackend(tiny, tiny_plan(tiny), 32)
    assert second.report.all_cached and len(_entries()) == 4


def test_corrupt_entry_is_rebuilt_with_warning(tiny, caplog):
    plan = tiny_plan(tiny)
    NpuBackend(tiny, plan, 16, layers=[0])
    entry = _entries()[0]
    data = bytearray((entry / "compiled.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, flipped bits
    (entry / "compiled.onnx").write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        be = NpuBackend(tiny, plan, 16, layers=[0])
    assert "corrupt" in caplog.text and "rebuilding" in caplog.text
    assert sum(not r[3] for r in be.report.rows) == 1
    assert NpuBackend(tiny, plan, 16, layers=[0]).report.all_cached


def test_stale_or_interrupted_entry_is_rebuilt(tiny, caplog):
    plan = tiny_plan(tiny)
    NpuBackend(tiny, plan, 16, layers=[0])
    a, b = _entries()
    meta = json.loads((a / "meta.json").read_text())
    meta["key"] = "0" * 32
    (a / "meta.json").write_text(json.dumps(meta))
    (b / "meta.json").unlink()  # an interrupted build: files but no meta
    with caplog.at_level(logging.WARNING):
        be = NpuBackend(tiny, plan, 16, layers=[0])
    assert "stale" in caplog.text and "interrupted" in caplog.text
    assert not any(r[3] for r in be.report.rows)


def test_touched_entry_is_verified_by_content_and_kept(tiny, caplog):
    # same bytes, new mtime (a copied or touched cache): its content hash matches, so it is kept as it is
    plan = tiny_plan(tiny)
    NpuBackend(tiny, plan, 16, layers=[0])
    entry = _entries()[0]
    meta = (entry / "meta.json").read_text()
    st = (entry / "compiled.onnx").stat()
    os.utime(entry / "compiled.onnx", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with caplog.at_level(logging.WARNING):
        assert NpuBackend(tiny, plan, 16, layers=[0]).report.all_cached
    assert "rebuilding" not in caplog.text and (entry / "meta.json").read_text() == meta


def test_damage_that_kept_the_stamp_is_caught(tiny, caplog):
    # bit rot or a `cp -p` restore keeps the mtime: the content hash, not the stamp, decides
    plan = tiny_plan(tiny)
    NpuBackend(tiny, plan, 16, layers=[0])
    for entry in _entries():
        p = entry / "compiled.onnx"
        st = p.stat()
        data = bytearray(p.read_bytes())
        data[-10] ^= 0x01
        p.write_bytes(bytes(data))
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    entry = _entries()[0]
    with pytest.raises(GraphCacheError, match="corrupt"):
        CacheEntry(entry, entry.name).read_compiled()
    with caplog.at_level(logging.WARNING):
        be = NpuBackend(tiny, plan, 16, layers=[0])
    assert not any(r[3] for r in be.report.rows)  # both entries rebuilt ...
    assert caplog.text.count("rebuilding") == 1  # ... with one warning


def test_cache_usage_and_clear(tiny):
    NpuBackend(tiny, tiny_plan(tiny), 16, layers=[0])
    (graphs_root() / "ort-cpu" / ("0" * 32)).mkdir()  # an unfinished entry
    use = cache_usage()["ort-cpu"]
    assert use["entries"] == 2 and use["other"] == 1 and use["bytes"] > 0
    assert clear_cache(only_stale=True) == 0 and cache_usage()["ort-cpu"]["other"] == 0
    assert clear_cache() > 0 and cache_usage()["ort-cpu"] == {"entries": 0, "other": 0, "bytes": 0}


def test_failed_compile_leaves_nothing_on_disk(tiny):
    from hetero.npu import segments
    from hetero.npu.providers import OrtCpuProvider, prepare_graph

    class Failing(OrtCpuProvider):
        def compile(self, model_path, out_path, ops=False):
            raise RuntimeError("QNN_COMMON_ERROR_MEM_ALLOC (test)")

    lq = segments.layer_q(tiny.config, tiny.arrays(), tiny_plan(tiny), 0)
    spec = segments.SegmentSpec(0, "qkv", ("qkv",), 16, "cpu")
    with pytest.raises(GraphCacheError, match="failed to compile layer 0 qkv"):
        prepare_graph(spec, lq, tiny.fingerprint, Failing())
    assert not (graphs_root() / "ort-cpu").exists() or not any((graphs_root() / "ort-cpu").iterdir())


def test_every_key_holds_the_graph_builders_source(monkeypatch):
    """An edit to a module that builds or compiles graphs (an experiment, an upgrade that forgot its version bump)
    gives every graph another key: another build's graph is never loaded under the old one."""
    from hetero.npu import cache

    root = Path(cache.__file__).resolve().parents[1]
    assert all((root / rel).is_file() for rel in cache.GRAPH_BUILDERS)
    before = cache.entry_key("hetero-graph", 1, "layer")
    monkeypatch.setattr(cache, "builders_digest", lambda: "an edited export.py")
    assert cache.entry_key("hetero-graph", 1, "layer") != before
