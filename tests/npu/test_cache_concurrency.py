"""The graph cache shared by processes: one entry built concurrently stays intact (two builders once corrupted
it for good, silently)."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import time

import numpy as np

from hetero.npu.graph_backend import NpuBackend
from hetero.npu.cache import CacheEntry, graphs_root
from tests.conftest import make_tiny_model
from tests.npu.conftest import tiny_plan


def _build_and_run(cache: str, barrier, out) -> None:
    """One process: wait for the other, build (or load) the graphs, run them on a fixed input."""
    os.environ["HETERO_CACHE"] = cache  # a fresh process: the environment is its own
    model = make_tiny_model()
    plan = tiny_plan(model)
    barrier.wait()
    be = NpuBackend(model, plan, 16)
    h = np.random.default_rng(1).standard_normal((16, 64), dtype=np.float32)
    q, k, v = be.qkv(0, h)
    o = be.o_ffn(0, np.ascontiguousarray(q[:, : 64]), h)
    out.put(hashlib.sha256(b"".join(t.tobytes() for t in (q, k, v, o))).hexdigest())


def _entries() -> list:
    return sorted(p for p in (graphs_root() / "ort-cpu").iterdir() if not p.name.startswith("."))


def test_two_processes_building_one_entry(graph_cache):
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_build_and_run, args=(str(graph_cache), barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    digests = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert digests[0] == digests[1]
    entries = _entries()
    assert len(entries) == 4  # qkv and o_ffn of both layers, each built once
    for e in entries:
        assert CacheEntry(e, e.name).read_compiled() is not None  # every file's content hash matches
    assert not list((graphs_root() / "ort-cpu").glob(".build-*"))  # no staging folder left
    # and a third, single process loading the entries computes the same outputs
    barrier1, out1 = ctx.Barrier(1), ctx.Queue()
    p = ctx.Process(target=_build_and_run, args=(str(graph_cache), barrier1, out1))
    p.start()
    assert out1.get(timeout=300) == digests[0]
    p.join(60)


def test_staging_of_a_killed_build_is_removed(tiny):
    plan = tiny_plan(tiny)
    NpuBackend(tiny, plan, 16, layers=[0])
    entry = _entries()[0]
    killed = entry.parent / f".build-{entry.name}-dead"  # what a build killed mid-way leaves
    killed.mkdir()
    (killed / "model.onnx").write_bytes(b"partial")
    entry_obj = CacheEntry(entry, entry.name)
    with entry_obj.lock(), entry_obj.staging() as stage:  # the next builder of that key
        (stage.root / "x").write_text("x")
    assert not killed.exists()


def test_old_staging_counts_as_stale(tiny):
    from hetero.npu.cache import STALE_STAGING_S, cache_usage, clear_cache

    NpuBackend(tiny, tiny_plan(tiny), 16, layers=[0])
    young = graphs_root() / "ort-cpu" / ".build-young"
    old = graphs_root() / "ort-cpu" / ".build-old"
    young.mkdir(), old.mkdir()
    t = time.time() - STALE_STAGING_S - 60
    os.utime(old, (t, t))
    assert cache_usage()["ort-cpu"]["other"] == 1
    clear_cache(only_stale=True)
    assert young.exists() and not old.exists()


def test_unwritable_cache_builds_uncached_with_a_warning(tiny, graph_cache, caplog):
    graph_cache.mkdir(parents=True, exist_ok=True)
    (graph_cache / "graphs").write_text("not a folder")  # mkdir under it fails, as in a read-only cache
    with caplog.at_level(logging.WARNING):
        be = NpuBackend(tiny, tiny_plan(tiny), 16, layers=[0])
    assert caplog.text.count("running uncached") == 1  # one warning, not one per graph
    assert not any(r[3] for r in be.report.rows)
    ref = NpuBackend(tiny, tiny_plan(tiny), 16, layers=[0])  # still uncached, same graphs
    h = np.random.default_rng(0).standard_normal((16, 64), dtype=np.float32)
    np.testing.assert_array_equal(be.qkv(0, h)[0], ref.qkv(0, h)[0])
