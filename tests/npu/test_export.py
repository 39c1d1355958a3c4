"""Export + CPU EP lane vs the INT8 reference (`hetero.outliers.shadow.QuantizedBackend`)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch

from hetero.npu import export
from hetero.npu.backend import NpuBackend
from hetero.npu.lanes import OrtCpuLane, prepare_graph
from hetero.outliers.quantize import int8_linear
from hetero.outliers.shadow import QuantizedBackend
from tests.conftest import make_tiny_model
from tests.npu.conftest import SHADOWS, tiny_plan


def test_layer_segments_follow_shadow_sites():
    kinds = lambda sh: [s.kind for s in export.layer_segments(0, sh, 16, "cpu")]  # noqa: E731
    assert kinds(set()) == ["qkv", "o_ffn"]
    assert kinds({"down_in"}) == ["qkv", "o_up", "down"]
    assert kinds({"o_in", "ffn_in", "down_in"}) == ["qkv", "o", "gu", "act", "down"]
    assert kinds({"attn_in"}) == ["qkv", "o_ffn"] and export.layer_segments(0, {"attn_in"}, 16, "cpu")[0].emit_x


@pytest.mark.parametrize("wg", ["channel", "tensor"])
def test_linear_outputs_bit_exact_same_float_input(tiny, wg):
    # The dequantized linear outputs of the graph equal quantize.int8_linear bit for bit when fed the
    # same float input (int32 accumulation, half-to-even rounding, one float32 scale multiply per column).
    plan = tiny_plan(tiny, weight_granularity=wg)
    lq = export.layer_q(tiny.config, tiny.weights.layers[0], plan, 0)
    spec = export.SegmentSpec(0, "qkv", ("qkv",), 16, "cpu", emit_x=True)
    g, _ = prepare_graph(spec, lq, tiny.fingerprint, OrtCpuLane())
    h = torch.randn(16, 64) * 3
    out = g.run({"h": h})
    x = out["x"].numpy()
    want = np.concatenate([int8_linear(x, 0.02, plan.weights[(0, n)]) for n in ("wq", "wk", "wv")], axis=1)
    assert np.array_equal(out["qkv"].numpy(), want)


def test_per_channel_weights_fold_into_output_scale(tiny, monkeypatch):
    # Per-channel weights: the same MatMulInteger over the same int8 values' layout, only the output
    # multiply is a per-column float32 vector s_x·s_w[col]; per tensor it stays one scalar.
    by = {}
    for wg in ("channel", "tensor"):
        lq = export.layer_q(tiny.config, tiny.weights.layers[0], tiny_plan(tiny, weight_granularity=wg), 0)
        m = export.build_segment(export.SegmentSpec(0, "qkv", ("qkv",), 16, "cpu"), lq)
        inits = {t.name: t for t in m.graph.initializer}
        mul = next(n for n in m.graph.node if n.op_type == "Mul" and n.input[1].startswith("acc_s"))
        by[wg] = (lq, onnx.numpy_helper.to_array(inits[mul.input[1]]), [n.op_type for n in m.graph.node])
    lq_c, s_c, ops_c = by["channel"]
    assert s_c.shape == (tiny.config.q_dim + 2 * tiny.config.kv_dim,) and len(set(s_c.tolist())) > 3
    assert len(set(by["tensor"][1].tolist())) <= 3  # per tensor: one value per linear (q, k, v)
    assert ops_c == by["tensor"][2]  # same graph structure: MatMulInteger → Cast → Mul
    assert np.ndim(lq_c.qkv[0].w_scale) == 1 and len(set(lq_c.qkv[0].w_scale.tolist())) > 1
    # the QDQ form, default: weight DQ with scale 1, MatMul, Mul by the per-column vector s_w[col]
    spec_q = export.SegmentSpec(0, "qkv", ("qkv",), 16, "qnn")
    mq = export.build_segment(spec_q, lq_c)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in mq.graph.initializer}
    muls = [n for n in mq.graph.node if n.op_type == "Mul" and n.input[1].startswith("w_s")]
    assert [inits[n.input[1]].tolist() for n in muls] == [lin.w_scale.tolist() for lin in lq_c.qkv]
    # ... or per-axis DequantizeLinear on the weight's output dim (axis=1 of [K, N]), where the EP takes it
    monkeypatch.setattr(export, "QNN_PER_AXIS_DQ", True)
    mq = export.build_segment(spec_q, lq_c)
    wdq = [n for n in mq.graph.node if n.op_type == "DequantizeLinear" and n.input[0].startswith("w_q")]
    assert len(wdq) == 3 and all(a.name == "axis" and a.i == 1 for n in wdq for a in n.attribute)


@pytest.mark.parametrize("wg", ["channel", "tensor"])
def test_qdq_form_matches_reference(tiny, wg):
    # the "qnn" flavour run on the CPU EP: float MatMul of dequantized values, so equal to the INT8
    # reference up to float32 rounding (per-channel scales folded after the MatMul or per tensor)
    plan = tiny_plan(tiny, weight_granularity=wg)
    lq = export.layer_q(tiny.config, tiny.weights.layers[0], plan, 0)
    m = export.build_segment(export.SegmentSpec(0, "qkv", ("qkv",), 16, "qnn", emit_x=True), lq)
    import onnxruntime as ort

    so = ort.SessionOptions()  # no QDQ fusion: the CPU EP would run it as u8·s8 (saturating on AVX2)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    h = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32) * 3
    qkv, x = sess.run(["qkv", "x"], {"h": h})
    want = np.concatenate([int8_linear(x, 0.02, plan.weights[(0, n)]) for n in ("wq", "wk", "wv")], axis=1)
    np.testing.assert_allclose(qkv, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wg", ["channel", "tensor"])
@pytest.mark.parametrize("shadow", [None, SHADOWS], ids=["plain", "shadows"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_layers_match_reference(shadow, arch, wg):
    # Whole layer vs the reference: the int part is exact; float ops (RMSNorm, SiLU) are computed by ORT
    # instead of torch, which may differ by float32 rounding (a few ulps of |h| ≲ 10 → 1e-5 absolute).
    m = make_tiny_model(arch)
    plan = tiny_plan(m, shadow, weight_granularity=wg)
    ref, be = QuantizedBackend(m.config, m.weights, plan), NpuBackend(m, plan, 16, lane="cpu")
    g = torch.Generator().manual_seed(1)
    h, a = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g) * 0.5
    for layer in range(2):
        for got, want in zip(be.qkv(layer, h), ref.qkv(layer, h)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(be.o_ffn(layer, a, h), ref.o_ffn(layer, a, h), rtol=0, atol=1e-5)


def test_equivalent_shape_3d_equals_2d(tiny):
    plan = tiny_plan(tiny)
    lq = export.layer_q(tiny.config, tiny.weights.layers[0], plan, 0)
    lane = OrtCpuLane()
    ins = {"a": torch.randn(16, 64), "h": torch.randn(16, 64)}
    outs = []
    for shape in ("2d", "3d:4"):
        spec = export.SegmentSpec(0, "o_ffn", export.PIECES, 16, "cpu", shape)
        outs.append(prepare_graph(spec, lq, tiny.fingerprint, lane)[0].run(dict(ins))["h_out"])
    assert torch.equal(outs[0], outs[1])
