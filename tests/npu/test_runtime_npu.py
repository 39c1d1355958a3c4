"""`Runtime(model, chunk=C, backend=NpuBackend(...))` end to end, and the naive whole-prompt path."""

from __future__ import annotations

import numpy as np
import torch

from hetero import model as ref
from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.npu.naive import graph_counts, naive_prefill
from hetero.outliers.shadow import QuantizedBackend
from hetero.runtime import Runtime
from tests.npu.conftest import SHADOWS, tiny_plan


def test_runtime_with_npu_backend_matches_reference(tiny):
    plan = tiny_plan(tiny, SHADOWS, scale=0.03)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    got = Runtime(tiny, chunk=16, backend=NpuBackend(tiny, plan, 16)).prefill(ids)
    want = Runtime(tiny, chunk=16, backend=QuantizedBackend(tiny.config, tiny.weights, plan)).prefill(ids)
    # float op rounding (ORT vs torch) only: see test_export.test_layers_match_reference
    np.testing.assert_allclose(got.logits, want.logits, rtol=0, atol=1e-4)
    np.testing.assert_allclose(got.cache.k[:, :, :40], want.cache.k[:, :, :40], rtol=0, atol=1e-4)


def test_dynamic_rows_equal_fixed_shape_graphs(tiny):
    plan = tiny_plan(tiny, SHADOWS, scale=0.03)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    dyn = Runtime(tiny, chunk=32, backend=NpuBackend(tiny, plan, 32))
    fixed = Runtime(tiny, chunk=32, backend=NpuBackend(tiny, plan, 32, options=GraphOptions(dynamic_rows=False)))
    assert [c.rows for c in dyn.plan(ids).chunks] == [32, 16] and [c.rows for c in fixed.plan(ids).chunks] == [32, 32]
    got, want = dyn.prefill(ids), fixed.prefill(ids)
    np.testing.assert_allclose(got.logits, want.logits, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got.cache.v[:, :, :40], want.cache.v[:, :, :40], rtol=0, atol=1e-5)


def test_naive_prompt_graph_runs(tiny):
    plan = tiny_plan(tiny, scale=0.03)
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(1))
    res = naive_prefill(tiny, plan, ids)
    logits, _, _ = ref.forward(tiny.config, tiny.weights, ids, backend=QuantizedBackend(tiny.config, tiny.weights, plan))
    assert isinstance(res.logits, np.ndarray) and res.logits.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(res.logits), logits[-1], rtol=0, atol=1e-4)
    assert res.n_graphs == 4 and res.prepare_s > 0


def test_graph_counts(tiny):
    rows = {g.strategy: g for g in graph_counts(tiny, 1024, 256)}
    assert rows["chunk_sharing"].n_graphs == 4 and rows["chunk_graphs"].n_graphs == 16
    assert rows["chunk_graphs"].weight_bytes == 4 * rows["chunk_sharing"].weight_bytes


def test_graphs_write_into_the_callers_buffers(tiny) -> None:
    """qkv/o_ffn write where the runtime asks (IOBinding), shadows added in place: no per-call outputs."""
    plan = tiny_plan(tiny, SHADOWS)
    be = NpuBackend(tiny, plan, 16)
    reference = QuantizedBackend(tiny.config, tiny.weights, plan)
    cfg = tiny.config
    g = torch.Generator().manual_seed(0)
    h, a = torch.randn(16, cfg.hidden, generator=g), torch.randn(16, cfg.q_dim, generator=g)
    for layer in range(cfg.n_layers):
        buf = np.empty((16, cfg.q_dim + 2 * cfg.kv_dim), np.float32)
        q, k, v = be.qkv(layer, h.numpy(), out=buf)
        assert np.shares_memory(q, buf) and q.ctypes.data == buf.ctypes.data
        for got, want in zip((q, k, v), reference.qkv(layer, h)):
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=1e-5)  # float ops in ORT vs torch
        out = np.empty((16, cfg.hidden), np.float32)
        assert be.o_ffn(layer, a.numpy(), h.numpy(), out=out) is out
        torch.testing.assert_close(torch.from_numpy(out), reference.o_ffn(layer, a, h), rtol=0, atol=1e-5)


def test_graphs_load_on_threads_as_on_one(monkeypatch):
    """`NpuBackend` builds (cold cache) and loads (warm) a model's layers on a few threads (a shorter start): the same
    prefill, bit for bit, as one thread building them, and its report in layer order."""
    from hetero.npu import graph_backend
    from tests.conftest import make_tiny_model

    m = make_tiny_model(n_layers=5)
    plan = tiny_plan(m, {(3, "down_in"): (1, 2), (4, "attn_in"): (3,)}, scale=0.03)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(graph_backend.os, "cpu_count", lambda: 4)
    cold, warm = NpuBackend(m, plan, 16), NpuBackend(m, plan, 16)
    assert not any(r[3] for r in cold.report.rows) and warm.report.all_cached
    monkeypatch.setattr(graph_backend, "PREPARE_THREADS", 1)
    one = NpuBackend(m, plan, 16)
    for be in (cold, warm):
        assert [r[:3] for r in be.report.rows] == [r[:3] for r in one.report.rows]
        assert [r[0] for r in be.report.rows] == sorted(r[0] for r in be.report.rows)
    got = [Runtime(m, chunk=16, backend=be).prefill(ids) for be in (cold, warm, one)]
    for r in got[:2]:
        np.testing.assert_array_equal(r.logits, got[2].logits)
        np.testing.assert_array_equal(r.cache.k[:, :, :40], got[2].cache.k[:, :, :40])


def test_a_prefill_is_freed_without_the_garbage_collector(tiny):
    """Nothing of a prefill is in a reference cycle: when its result is dropped, its cache (a 2,048-token prompt's K/V
    are 90 MB on the default model) goes at once, not when the collector next runs, whatever nodes ran it (the generic
    three on a float backend, whole-layer graphs, the halves on checked addresses, two lanes)."""
    import gc
    import weakref

    from hetero.native.attention import unavailable
    from hetero.npu.nodes import HALF_PLACEMENT, LAYER_PLACEMENT
    from hetero.chunking import ChunkRule
    from hetero.runtime import SerialExecutor
    from hetero.sched.wavefront import WavefrontExecutor
    from tests.conftest import make_tiny_model

    m = make_tiny_model(head_dim=32)
    plan = tiny_plan(m, SHADOWS, scale=0.03)
    n = m.config.n_layers
    layers = NpuBackend(m, plan, 32, options=GraphOptions(fused=True))
    runtimes = {"float": Runtime(m, chunk=32), "segments": Runtime(m, chunk=32, backend=NpuBackend(m, plan, 32)),
                "layers": Runtime(m, chunk=32, backend=layers, executor=SerialExecutor(n, LAYER_PLACEMENT)),
                "lanes": Runtime(m, chunk=ChunkRule(32, lanes=2), backend=layers,
                                 executor=WavefrontExecutor(n, LAYER_PLACEMENT))}
    if unavailable(m.config) is None:  # the halves on addresses (`npu.nodes.HalvesAt`) need the BF16 kernel
        halves = NpuBackend(m, plan, 32, options=GraphOptions(fused=True, attention="bf16"))
        runtimes["halves"] = Runtime(m, chunk=32, backend=halves, executor=SerialExecutor(n, HALF_PLACEMENT))
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(5))
    gc.collect()
    gc.disable()
    try:
        for name, rt in runtimes.items():
            got = rt.prefill(ids)
            assert got.cache.length == 70
            cache = weakref.ref(got.cache)
            del got
            assert cache() is None, f"{name}: the prefill's cache outlived its result"
    finally:
        gc.enable()
        for rt in runtimes.values():
            rt.close()
