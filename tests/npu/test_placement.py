"""NPU memory budget (§4): FFN graphs first, then QKV, the rest INT8 on the CPU."""

from __future__ import annotations

import numpy as np

from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.npu.placement import graph_weight_bytes, place
from tests.npu.conftest import tiny_plan


def test_ffn_first_then_qkv(tiny):
    cfg = tiny.config
    ffn, qkv = graph_weight_bytes(cfg, "o_ffn"), graph_weight_bytes(cfg, "qkv")
    p = place(cfg, 2 * ffn + qkv)
    assert [p.device_of(layer, "o_ffn") for layer in range(2)] == ["npu", "npu"]
    assert [p.device_of(layer, "qkv") for layer in range(2)] == ["npu", "cpu"]
    assert all(d.reason for d in p.decisions) and p.npu_bytes == 2 * ffn + qkv
    assert all(d.device == "cpu" for d in place(cfg, 0).decisions)
    assert all(d.device == "npu" for d in place(cfg, None).decisions)


def test_backend_follows_placement(tiny):
    p = place(tiny.config, graph_weight_bytes(tiny.config, "o_ffn"))
    be = NpuBackend(tiny, tiny_plan(tiny), 16, provider="cpu", options=GraphOptions(placement=p))
    assert be.program(0).runs[1].graph.device == "cpu"  # the CPU provider serves both (no QNN here)
    h = np.random.default_rng(0).standard_normal((16, 64), dtype=np.float32)
    assert be.qkv(1, h)[0].shape == (16, 64)


def test_prefill_layout_per_host(tiny, tmp_path):
    """An NPU keeps §3.4's lanes; the CPU EP lays each layer out as one graph unless this host measured otherwise."""
    import dataclasses

    from hetero.npu.placement import layout_key, prefill_layout, record_layout, recorded_layout

    cfg = tiny.config
    assert prefill_layout(cfg, "npu", 2).mode == "lanes"
    rule = prefill_layout(cfg, "cpu", 2)
    assert rule.mode == "layers" and "not measured on this host" in rule.reason
    qk = dataclasses.replace(cfg, qk_norm=True)  # attention the in-graph kernel does not compute
    assert prefill_layout(qk, "cpu", 2).mode == "lanes"
    path, key = tmp_path / "layout.json", layout_key(tiny, 16, 2)
    assert recorded_layout(key, path) is None
    entry = record_layout(key, {"layers": {64: 50.0, 256: 300.0}, "lanes": {64: 60.0, 256: 250.0}}, path)
    assert entry["winner"] == "lanes" and recorded_layout(key, path) == entry  # the faster in total
    measured = prefill_layout(cfg, "cpu", 2, recorded_layout(key, path))
    assert measured.mode == "lanes" and "measured on this host" in measured.reason
    assert recorded_layout(layout_key(tiny, 32, 2), path) is None  # another C: not measured


def test_make_runtime_lays_out_the_prefill(tiny, monkeypatch):
    """The default method on the CPU EP: whole-layer graphs in program order; a policy or "hetero-lanes": lanes."""
    import hetero.methods as methods
    from hetero.npu.nodes import LAYER_PLACEMENT

    monkeypatch.setattr(methods, "quant_plan", lambda model, *a, **k: tiny_plan(model, scale=0.03))
    monkeypatch.setattr(methods, "quant_model", lambda model, recipe: model)
    rt = methods.make_runtime(tiny, "hetero", chunk=16, threads=2)
    assert rt.layout.mode == "layers" and rt.placement == LAYER_PLACEMENT and rt.backend.fused
    ids = np.random.default_rng(0).integers(0, 256, 40)
    lanes = methods.make_runtime(tiny, "hetero-lanes", chunk=16, threads=2)
    assert lanes.layout.mode == "lanes" and not lanes.backend.fused
    np.testing.assert_allclose(rt.prefill(ids).logits, lanes.prefill(ids).logits, rtol=0, atol=1e-4)
    assert methods.make_runtime(tiny, "hetero", chunk=16, threads=2, policy="in_order").layout.mode == "lanes"
    for r in (rt, lanes):
        r.close()
