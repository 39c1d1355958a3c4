"""`hetero.buffers`: aligned host buffers, and the KV caches' recycled mappings."""

from __future__ import annotations

import gc
import resource

from hetero import buffers
from hetero.kv_cache import KVCache
from tests.conftest import make_tiny_model


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_dropped_mapping_serves_the_next_array_of_its_size_with_its_pages(monkeypatch):
    monkeypatch.setattr(buffers, "_pool", type(buffers._pool)())
    shape = (4, 1 << 18)  # 4 MB
    a = buffers.recycled(shape)
    assert a.ctypes.data % buffers.ALIGN == 0 and a.flags.c_contiguous and a.flags.writeable
    a[:] = 3.0
    address, view = a.ctypes.data, a[1]
    del a
    gc.collect()
    assert not buffers._pool  # a view still holds the mapping
    del view
    assert [len(m) for m in buffers._pool.values()] == [1]
    before = _faults()
    b = buffers.recycled(shape)
    b[:] = 1.0  # pages committed by the first array: no fault
    assert b.ctypes.data == address and _faults() - before < 16
    c = buffers.recycled(shape)  # none free: a new mapping
    assert c.ctypes.data != address and not buffers._pool
    other = buffers.recycled((3, 1 << 18))
    del b, c, other
    assert sum(map(len, buffers._pool.values())) == buffers.POOLED  # the least recently returned dropped
    assert list(buffers._pool) == [4 << 20, 3 << 20]


def test_kv_caches_reuse_the_mappings_of_dropped_ones(monkeypatch):
    monkeypatch.setattr(buffers, "_pool", type(buffers._pool)())
    cfg = make_tiny_model().config
    capacity = 8 * (buffers.MAPPED // (cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4))  # arrays of 8 MB
    first = KVCache(cfg, capacity)
    addresses = {first.k.ctypes.data, first.v.ctypes.data}
    first.k[:] = 1.0
    del first
    second = KVCache(cfg, capacity)
    assert {second.k.ctypes.data, second.v.ctypes.data} == addresses and second.length == 0


def test_small_recycled_arrays_are_plain_aligned_ones():
    a = buffers.recycled((4, 4))
    assert a.shape == (4, 4) and not isinstance(a.base, buffers._Lease) and a.ctypes.data % buffers.ALIGN == 0
