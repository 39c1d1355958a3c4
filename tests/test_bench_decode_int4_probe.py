"""`hetero.bench.decode_int4_probe` builds a layer's float graphs that equal `hetero.model`'s layer, quantizes their
MatMuls to ONNX Runtime's `MatMulNBits`, reads the 4-bit weights back, and renders its table; no timing thresholds
here (bench/)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from hetero import model as ref
from hetero.bench.decode_int4_probe import (
    GraphLayers, _Capture, agreement, bound_runs, graph_errors, greedy, grid_blocks, layer_graphs, markdown, on_grid,
    quantize, time_variants, weight_bytes, with_level)
from hetero.errors import ConfigError
from tests.conftest import make_tiny_model


def _run(graph, feeds):
    return ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_the_float_graphs_are_the_reference_layer():
    m = make_tiny_model()
    cfg, lw = m.config, m.weights.layers[0]
    qkv, o_ffn = layer_graphs(cfg, lw)
    h, a = torch.randn(3, cfg.hidden), torch.randn(3, cfg.q_dim)
    q, k, v = ref.qkv(cfg, lw, h)
    np.testing.assert_allclose(_run(qkv, {"h": h.numpy()}), torch.cat([q, k, v], 1).numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(_run(o_ffn, {"a": a.numpy(), "h": h.numpy()}), ref.o_ffn(cfg, lw, a, h).numpy(),
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match="biases"):
        layer_graphs(make_tiny_model(qkv_bias=True).config, make_tiny_model(qkv_bias=True).weights.layers[0])


def test_the_4bit_graphs_hold_4bit_weights_and_read_back():
    pytest.importorskip("onnx_ir", reason="ORT's MatMulNBitsQuantizer needs onnx-ir (the optional extra 'bench')")
    m = make_tiny_model()
    cfg, lw = m.config, m.weights.layers[0]
    floats = layer_graphs(cfg, lw)
    quants = tuple(quantize(g, 32, 0) for g in floats)
    assert all(n.op_type != "MatMul" for g in quants for n in g.graph.node)
    assert weight_bytes(quants[1]) < weight_bytes(floats[1]) / 4  # 4 bits and a scale per 32 weights vs 32 bits
    x = torch.randn(2, cfg.hidden)
    y, yf = _run(quants[0], {"h": x.numpy()}), _run(floats[0], {"h": x.numpy()})
    assert 0 < np.abs(y - yf).max() < 0.2 * np.abs(yf).max()  # rounded weights, not other ones
    assert all(a.i == 4 for n in with_level(quants[0], 4).graph.node for a in n.attribute if a.name == "accuracy_level")


def test_errors_greedy_inputs_timing_and_table():
    pytest.importorskip("onnx_ir", reason="ORT's MatMulNBitsQuantizer needs onnx-ir (the optional extra 'bench')")
    m = make_tiny_model()
    cfg, w = m.config, m.weights
    floats = [layer_graphs(cfg, lw) for lw in w.layers]
    quants = [tuple(quantize(g, 32, 0) for g in pair) for pair in floats]
    cap = _Capture(cfg, w)
    h, _, _ = ref.run_layers(cfg, w, torch.arange(10), cap)
    torch.testing.assert_close(h, ref.run_layers(cfg, w, torch.arange(10))[0])  # capturing changes nothing
    errors = graph_errors(floats, quants, cap.inputs)
    assert len(errors) == cfg.n_layers and all(0 < e["qkv"]["mean"] < 0.5 for e in errors)
    assert graph_errors(floats, floats, cap.inputs)[0]["o_ffn"]["max"] == 0.0
    logits = ref.forward(cfg, w, torch.arange(10))[0]
    torch.testing.assert_close(ref.forward(cfg, w, torch.arange(10), GraphLayers(cfg, floats))[0], logits,
                               rtol=1e-4, atol=1e-4)  # the float graphs as layers: the reference
    four = ref.forward(cfg, w, torch.arange(10), GraphLayers(cfg, quants))[0]
    assert not torch.allclose(four, logits, atol=1e-4) and len(greedy(cfg, w, [1, 2, 3], 3, GraphLayers(cfg, quants))) == 3
    assert agreement([1, 2, 3, 4], [1, 2, 5, 4]) == {"prefix": 2, "equal": 3, "of": 4}
    made = [bound_runs(g, 1) for g in quants[0]]
    _, run3, bufs = bound_runs(quants[0][0], 1, rows=3)
    run3()
    assert bufs["qkv"].shape == (3, cfg.q_dim + 2 * cfg.kv_dim)
    np.testing.assert_allclose(bufs["qkv"], _run(quants[0][0], {"h": bufs["h"]}), rtol=1e-5, atol=1e-6)  # bound in place
    timed = time_variants({"int4": [[x[1] for x in made]]}, repeats=2)
    assert {k: type(v) for k, v in timed["int4"].items() if k.endswith("_ms")} == {  # measured values; sizes: bench/
        "layer0_ms": float, "all_layers_ms": float}
    row = {"layer0_ms": 1.0, "all_layers_ms": 2.0}
    table = markdown({"model": "tiny", "command": "c", "cpu": {}, "note": "", "layers": 2, "repeats": 2, "threads": [1],
                      "weight_mb": {"int8": 1.0, "int4 b32": 0.6}, "timing": {"1": {"int8": row, "int4 b32 a4": row}},
                      "errors": {"int4 b32 a0": errors}, "rows": {"2": {"int8": 1.5, "int4 b32 a4": 1.25}}, "accuracy_tokens": 10, "greedy": {}, "greedy_tokens": 0})
    assert "| int4 b32 a4 | 1 | 0.6 | 1.0 | 2.0 | 1.00× |" in table and "| 2 | 1.5 | 1.25 |" in table


def test_weights_on_a_q4_1_grid_run_exactly():
    m = make_tiny_model()
    cfg, lw = m.config, m.weights.layers[0]
    g = torch.Generator().manual_seed(1)

    def q4_1(w: torch.Tensor) -> torch.Tensor:  # w as a GGUF Q4_1 tensor holds it: d·q + m per 32 inputs of a row
        b = w.reshape(w.shape[0], -1, 32)
        lo, d = b.min(-1, keepdim=True).values, (b.max(-1, keepdim=True).values - b.min(-1, keepdim=True).values) / 15
        q = torch.randint(0, 16, b.shape, generator=g)
        q[..., 0], q[..., 1] = 0, 15  # Q4_1 maps a block's least value to 0 and its largest to 15
        return (q * d + lo).reshape(w.shape)

    for name in ("wo", "w_gate", "w_up", "w_down"):
        setattr(lw, name, q4_1(getattr(lw, name)))
    _, o_ffn = layer_graphs(cfg, lw)
    grid, err = on_grid(o_ffn, 0)
    assert err < 1e-6 and sum(n.op_type == "MatMulNBits" for n in grid.graph.node) == 3
    a, h = torch.randn(3, cfg.q_dim), torch.randn(3, cfg.hidden)
    np.testing.assert_allclose(_run(grid, {"a": a.numpy(), "h": h.numpy()}), ref.o_ffn(cfg, lw, a, h).numpy(),
                               rtol=1e-4, atol=1e-5)
    assert grid_blocks(torch.randn(4, 64).numpy())[3] > 1e-3  # weights off any grid: a grid error
