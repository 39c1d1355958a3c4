"""Export + CPU EP provider vs the INT8 reference (`hetero.outliers.shadow.QuantizedBackend`)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch

from hetero.errors import ConfigError
from hetero.npu import export, segments
from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.npu.providers import OrtCpuProvider, prepare_graph
from hetero.weights import SITES
from hetero.outliers.plan import plan_from_scales
from hetero.outliers.quantize import int8_linear
from hetero.outliers.shadow import QuantizedBackend
from hetero.sessions import cpu_session
from tests.conftest import make_tiny_model
from tests.npu.conftest import SHADOWS, assert_layers_match, tiny_plan


def test_layer_segments_follow_shadow_sites():
    kinds = lambda sh: [s.kind for s in segments.layer_segments(0, sh, 16, "cpu")]  # noqa: E731
    assert kinds(set()) == ["qkv", "o_ffn"]
    assert kinds({"down_in"}) == ["qkv", "o_up", "down"]
    assert kinds({"o_in", "ffn_in", "down_in"}) == ["qkv", "o", "gu", "act", "down"]
    assert kinds({"attn_in"}) == ["qkv", "o_ffn"] and segments.layer_segments(0, {"attn_in"}, 16, "cpu")[0].emit_x
    assert kinds({"ffn_in", "down_in"}) == ["qkv", "o+gu", "act", "down"]


@pytest.mark.parametrize("sites", [("ffn_in", "down_in"), ("o_in", "down_in"), ("down_in",)])
def test_every_cut_of_a_layer_exports_and_matches(sites):
    # every way shadows can cut a layer's o→down run exports and computes the reference; a lone `act`
    # segment (cut after gu and after act) passes the residual through instead of redefining it
    m = make_tiny_model("llama")
    shadow = {(layer, s): (1, 4) for layer in range(m.config.n_layers) for s in sites}
    assert_layers_match(m, tiny_plan(m, shadow), atol=1e-5)


@pytest.mark.parametrize("wg", ["channel", "tensor"])
def test_linear_outputs_bit_exact_same_float_input(tiny, wg):
    # The dequantized linear outputs of the graph equal quantize.int8_linear bit for bit when fed the
    # same float input (int32 accumulation, half-to-even rounding, one float32 scale multiply per column).
    plan = tiny_plan(tiny, weight_granularity=wg)
    lq = segments.layer_q(tiny.config, tiny.arrays(), plan, 0)
    spec = segments.SegmentSpec(0, "qkv", ("qkv",), 16, "cpu", emit_x=True)
    g, _ = prepare_graph(spec, lq, tiny.fingerprint, OrtCpuProvider())
    h = np.random.default_rng(0).standard_normal((16, 64), dtype=np.float32) * 3
    out = g.run({"h": h})
    x = out["x"]
    want = np.concatenate([int8_linear(x, 0.02, plan.weights[(0, n)]) for n in ("wq", "wk", "wv")], axis=1)
    assert np.array_equal(out["qkv"], want)


def test_per_channel_weights_fold_into_output_scale(tiny, monkeypatch):
    # Per-channel weights: the same integer GEMM over the same int8 values' layout, only the output
    # scale (MatMulIntegerToFloat's b_scale) is a per-column float32 vector s_x·s_w[col]; per tensor one scalar.
    by = {}
    for wg in ("channel", "tensor"):
        lq = segments.layer_q(tiny.config, tiny.arrays(), tiny_plan(tiny, weight_granularity=wg), 0)
        m = export.build_segment(segments.SegmentSpec(0, "qkv", ("qkv",), 16, "cpu"), lq)
        inits = {t.name: t for t in m.graph.initializer}
        mm = next(n for n in m.graph.node if n.op_type == "MatMulIntegerToFloat")
        assert onnx.numpy_helper.to_array(inits[mm.input[2]]) == 1.0  # a_scale 1: float(acc)·(1·s) = float(acc)·s
        by[wg] = (lq, onnx.numpy_helper.to_array(inits[mm.input[3]]), [n.op_type for n in m.graph.node])
    lq_c, s_c, ops_c = by["channel"]
    assert s_c.shape == (tiny.config.q_dim + 2 * tiny.config.kv_dim,) and len(set(s_c.tolist())) > 3
    assert len(set(by["tensor"][1].tolist())) <= 3  # per tensor: one value per linear (q, k, v)
    assert ops_c == by["tensor"][2]  # same graph structure: QuantizeLinear → MatMulIntegerToFloat
    assert np.ndim(lq_c.qkv[0].w_scale) == 1 and len(set(lq_c.qkv[0].w_scale.tolist())) > 1
    # the QDQ form, default: weight DQ per tensor at max s_w, MatMul, Mul by the per-column ratio s_w[col] / max s_w
    spec_q = segments.SegmentSpec(0, "qkv", ("qkv",), 16, "qnn")
    mq = export.build_segment(spec_q, lq_c)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in mq.graph.initializer}
    muls = [n for n in mq.graph.node if n.op_type == "Mul" and n.input[1].startswith("w_s")]
    wdq = [n for n in mq.graph.node if n.op_type == "DequantizeLinear" and n.input[0].startswith("w_q")]
    for mul, dq, lin in zip(muls, wdq, lq_c.qkv, strict=True):
        w_s = inits[dq.input[1]]
        assert w_s.size == 1 and float(w_s[0]) == lin.w_scale.max()  # one per-tensor scale
        np.testing.assert_allclose(inits[mul.input[1]] * w_s, lin.w_scale, rtol=1e-6)
    # ... or per-axis DequantizeLinear on the weight's output dim (axis=1 of [K, N]), where the EP takes it
    monkeypatch.setattr(export, "QNN_PER_AXIS_DQ", True)
    mq = export.build_segment(spec_q, lq_c)
    wdq = [n for n in mq.graph.node if n.op_type == "DequantizeLinear" and n.input[0].startswith("w_q")]
    assert len(wdq) == 3 and all(a.name == "axis" and a.i == 1 for n in wdq for a in n.attribute)


@pytest.mark.parametrize("flavor", ["qnn", "qnn-fp16"])
@pytest.mark.parametrize("wg", ["channel", "tensor"])
def test_qdq_form_matches_reference(tiny, wg, flavor):
    # the QDQ flavours run on the CPU EP: float MatMul of dequantized values, so equal to the INT8
    # reference up to float32 rounding (per-channel scales folded after the MatMul or per tensor); the
    # fp16-safe RMSNorm of "qnn-fp16" (on x / max|x|) equals the textbook one up to rounding
    from hetero import model as ref

    plan = tiny_plan(tiny, weight_granularity=wg)
    lq = segments.layer_q(tiny.config, tiny.arrays(), plan, 0)
    m = export.build_segment(segments.SegmentSpec(0, "qkv", ("qkv",), 16, flavor, emit_x=True), lq)
    # no QDQ fusion: the CPU EP would run it as u8·s8 (saturating on AVX2)
    sess = cpu_session(m.SerializeToString(), None, optimize="none")
    h = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32) * 3
    h[3] *= 1e4  # a massive-activation row: x² beyond fp16's range, harmless in either form here
    qkv, x = sess.run(["qkv", "x"], {"h": h})
    want_x = ref.rms_norm(torch.from_numpy(h), tiny.weights.layers[0].attn_norm, tiny.config.rms_eps).numpy()
    np.testing.assert_allclose(x, want_x, rtol=1e-5, atol=1e-5)
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
    assert_layers_match(m, plan, atol=1e-5)


@pytest.mark.parametrize("kind", ["qkv", "o_ffn"])
def test_equivalent_shapes_equal_2d_bit_for_bit(tiny, kind):
    # [C, K] vs [a, b, K] vs a 1x1 ConvInteger over [1, K, a, b]: the same int32 products, the same outputs
    plan = tiny_plan(tiny, SHADOWS)
    lq = segments.layer_q(tiny.config, tiny.arrays(), plan, 0)
    provider = OrtCpuProvider()
    g = np.random.default_rng(1)
    ins = {"a": g.standard_normal((16, 64), dtype=np.float32), "h": g.standard_normal((16, 64), dtype=np.float32)}
    pieces = ("qkv",) if kind == "qkv" else segments.PIECES
    outs = []
    for shape in ("2d", "3d:4", "conv:1", "conv:4", "conv:16"):
        spec = segments.SegmentSpec(0, kind, pieces, 16, "cpu", shape)
        outs.append(prepare_graph(spec, lq, tiny.fingerprint, provider)[0].run(dict(ins)))
    for other in outs[1:]:
        for name, t in outs[0].items():
            np.testing.assert_array_equal(t, other[name], err_msg=name)


@pytest.mark.parametrize("shape", ["3d", "conv:5", "conv:x", "1d:2"])
def test_bad_equivalent_shape_is_a_clear_error(shape):
    with pytest.raises(ConfigError, match="shape must be"):
        segments.SegmentSpec(0, "qkv", ("qkv",), 16, "cpu", shape)


def test_weight_form_of_a_plan_given_only_its_range():
    # vpmaddubsw sums two u8·s8 products into a saturating int16: 2·255·64 = 32640 fits, 2·255·65 does not
    from hetero.outliers.quantize import form_for_qmax

    assert form_for_qmax(64) == form_for_qmax(63) == "w7-u8s8"
    assert form_for_qmax(65) == form_for_qmax(127) == "w8-u8u8"
    assert export.cpu_kernel("w8-u8s8") == "u8s8" and export.cpu_kernel("w8-u8u8") == "u8u8"


@pytest.mark.parametrize("form", ["w7-u8s8", "w8-u8u8", "w8-u8s8"])
@pytest.mark.parametrize("fill", [255, 0])
def test_cpu_graph_bit_exact_on_extreme_activations(tiny, form, fill):
    # Quantized activations all 255 (or all 0) as u8 against weights at the edge of their range: the worst
    # case of ORT's u8·s8 kernel on AVX2 (int16 pair sums 2·255·|q|). Each weight form is forced here, so
    # every form is tested on every machine; "w8-u8s8" (8-bit u8·s8) is exact only with VNNI: on AVX2
    # without it the saturation is real (2·255·127 > 32767), and only the graph's structure is checked.
    from hetero.npu.isa import has_vnni
    from hetero.outliers.quantize import WEIGHT_FORMS, QuantWeightPerChannel, quantize_act

    qmax = WEIGHT_FORMS[form].qmax
    plan = plan_from_scales(tiny, {(l, s): 0.02 for l in range(2) for s in SITES}, weight_form=form)
    assert plan.weight_qmax == qmax and plan.weight_form == form
    w = plan.weights[(0, "wo")]
    q = w.q.copy()  # rows of all +qmax, all -qmax, alternating, then the real weights
    q[0], q[1], q[2, 0::2], q[2, 1::2] = qmax, -qmax, qmax, -qmax
    plan.weights[(0, "wo")] = QuantWeightPerChannel(q, w.scales)
    lq = segments.layer_q(tiny.config, tiny.arrays(), plan, 0)
    assert lq.weight_qmax == qmax and lq.weight_form == form
    spec = segments.SegmentSpec(0, "o", ("o",), 16, "cpu")
    m = export.build_segment(spec, lq)
    inits = {t.name: t for t in m.graph.initializer}
    mmi = next(n for n in m.graph.node if n.op_type == "MatMulIntegerToFloat")  # A, B, a_s, b_s, a_zp, b_zp
    want_dtype = onnx.TensorProto.INT8 if WEIGHT_FORMS[form].kernel == "u8s8" else onnx.TensorProto.UINT8
    assert inits[mmi.input[1]].data_type == want_dtype and inits[mmi.input[5]].data_type == want_dtype
    if WEIGHT_FORMS[form].needs_vnni and not has_vnni():
        pytest.skip("8-bit u8·s8 saturates on AVX2 without VNNI (structure checked, numbers not exact here)")
    g, _ = prepare_graph(spec, lq, tiny.fingerprint, OrtCpuProvider())
    a = np.full((16, 64), 100.0 if fill == 255 else -100.0, np.float32)  # |a| / 0.02 ≫ 127: clips to u8 255 / 0
    a[8:, ::3] = 0.0  # plus some mid-range u8 128 rows/columns
    assert (quantize_act(a[:8], 0.02) == fill).all()
    got = g.run({"a": a})["o"]
    assert np.array_equal(got, int8_linear(a, 0.02, plan.weights[(0, "wo")]))


def test_plan_rejects_a_7bit_form_with_8bit_weights(tiny):
    from hetero.outliers.plan import QuantPlan

    plan = plan_from_scales(tiny, {(l, s): 0.02 for l in range(2) for s in SITES}, weight_form="w8-u8s8")
    with pytest.raises(ConfigError, match="w7-u8s8 needs weight_qmax"):
        QuantPlan(plan.sites, plan.weights, weight_qmax=127, weight_form="w7-u8s8")
    with pytest.raises(ConfigError, match="weight form must be one of"):
        plan_from_scales(tiny, {(l, s): 0.02 for l in range(2) for s in SITES}, weight_form="w9")


def test_layer_digest_depends_on_weight_form(tiny):
    # the graph cache key holds the weight form: the same 8-bit weights as u8·s8 and as u8·u8 are two graphs
    scales = {(l, s): 0.02 for l in range(2) for s in SITES}
    d = {f: segments.layer_digest(segments.layer_q(tiny.config, tiny.arrays(),
                                                   plan_from_scales(tiny, scales, weight_form=f), 0))
         for f in ("w7-u8s8", "w8-u8u8", "w8-u8s8")}
    assert len(set(d.values())) == 3


def test_profile_shapes_records_a_winner_among_the_candidates(tiny, tmp_path):
    from hetero.npu.shapes import candidates, profile_shapes, recorded_shape

    path = tmp_path / "shapes.json"
    table = profile_shapes(tiny, tiny_plan(tiny), [16], OrtCpuProvider(1), repeats=2, path=path)
    assert {"conv:1", "conv:4", "3d:4", "2d"} <= set(candidates(16))
    for e in table["entries"]:
        assert set(e["latency_us"]) == set(candidates(16)) and all(v > 0 for v in e["latency_us"].values())
        assert e["winner"] == min(e["latency_us"], key=e["latency_us"].get) and e["simulated"] is False
        assert recorded_shape("ort-cpu", e["kind"], 16, path) == e["winner"]
    assert recorded_shape("ort-cpu", "qkv", 32, path) == "2d"  # nothing recorded: the plain shape


def test_backend_uses_the_recorded_shape_by_default(tiny, tmp_path, monkeypatch):
    import json

    from hetero.npu import shapes

    table = {"version": 1, "host": "test", "entries": [
        {"provider": "ort-cpu", "kind": "qkv", "chunk_len": 16, "winner": "conv:4", "latency_us": {}},
        {"provider": "ort-cpu", "kind": "o_ffn", "chunk_len": 16, "winner": "3d:2", "latency_us": {}}]}
    (tmp_path / "t.json").write_text(json.dumps(table))
    monkeypatch.setattr(shapes, "shapes_path", lambda host=None, shipped=False: tmp_path / "t.json")
    plan = tiny_plan(tiny, SHADOWS)
    be = NpuBackend(tiny, plan, 16, options=GraphOptions(dynamic_rows=False))  # shape="auto"
    got = {g.spec.kind: g.spec.shape for layer in be.layers for g in (r.graph for r in be.program(layer).runs)}
    assert got["qkv"] == "conv:4" and all(v == "3d:2" for k, v in got.items() if k != "qkv")
    ref = QuantizedBackend(tiny.config, tiny.weights, plan)
    h, a = torch.randn(16, 64), torch.randn(16, 64) * 0.5
    got = torch.from_numpy(be.o_ffn(0, a.numpy(), h.numpy()))
    torch.testing.assert_close(got, ref.o_ffn(0, a, h), rtol=0, atol=1e-5)


def test_winner_must_fit_the_build_budget():
    from hetero.npu.shapes import pick_winner

    lat = {"2d": 100.0, "3d:4": 90.0, "conv:1": 50.0}
    assert pick_winner(lat, {}) == "conv:1"  # build times unknown (cached): fastest
    assert pick_winner(lat, {"2d": 0.2, "3d:4": 0.3, "conv:1": 30.0}) == "3d:4"  # conv:1 builds 150x slower
    assert pick_winner({}, {}) == "2d"
