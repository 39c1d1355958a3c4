"""`bench.fused_step` builds a model's whole decode step as one ONNX graph that ONNX Runtime runs (K/V written in
place, finite logits) and renders its table; no timing thresholds here (bench/)."""

from __future__ import annotations

import numpy as np
import onnx

from bench.fused_step import COLUMNS, markdown, step_graph, time_step
from tests.conftest import make_tiny_model


def test_the_fused_step_graph_runs():
    cfg = make_tiny_model().config
    graph = step_graph(cfg, capacity=40)
    assert len(onnx.load_from_string(graph).graph.node) > 10 * cfg.n_layers
    assert isinstance(time_step(cfg, graph, 40, context=20, threads=1, spin=False, steps=2, gap_ms=0.0), float)


def test_the_fused_step_writes_k_and_v_in_place():
    import onnxruntime as ort

    cfg = make_tiny_model().config
    cap, ctx = 16, 5
    session = ort.InferenceSession(step_graph(cfg, cap), providers=["CPUExecutionProvider"])
    shape = (1, cfg.n_kv_heads, cap, cfg.head_dim)
    caches = [np.zeros(shape, np.float32) for _ in range(2 * cfg.n_layers)]
    b = session.io_binding()
    b.bind_cpu_input("h0", np.ones((1, cfg.hidden), np.float32))
    b.bind_cpu_input("seqlens_k", np.array([ctx], np.int32))
    b.bind_cpu_input("total_len", np.array(ctx + 1, np.int32))
    b.bind_cpu_input("cos", np.ones((cap, cfg.head_dim // 2), np.float32))
    b.bind_cpu_input("sin", np.zeros((cap, cfg.head_dim // 2), np.float32))
    for layer in range(cfg.n_layers):
        for j, kv in enumerate(("k", "v")):
            buf = caches[2 * layer + j]
            b.bind_input(f"l{layer}_past_{kv}", "cpu", 0, np.float32, shape, buf.ctypes.data)
            b.bind_output(f"l{layer}_{kv}", "cpu", 0, np.float32, shape, buf.ctypes.data)
    logits = np.empty((1, cfg.vocab), np.float32)
    b.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
    session.run_with_iobinding(b)
    assert np.isfinite(logits).all()
    for buf in caches:  # the new token's row (position ctx) written, nothing after it
        assert np.abs(buf[:, :, ctx]).sum() > 0 and not buf[:, :, ctx + 1 :].any()
    table = markdown({"model": "tiny", "isa": {}, "command": "c",
                      "rows": [{"context": ctx, "ms": {c: 1.0 for c in COLUMNS}, "load": 0.5}]})
    assert "| 5 |" in table and "spinning" in table
