"""Export + CPU EP lane vs the INT8 reference (`hetero.outliers.shadow.QuantizedBackend`)."""

from __future__ import annotations

import numpy as np
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


def test_linear_outputs_bit_exact_same_float_input(tiny):
    # The dequantized linear outputs of the graph equal quantize.int8_linear bit for bit when fed the
    # same float input (int32 accumulation, half-to-even rounding, one float32 scale multiply).
    plan = tiny_plan(tiny)
    lq = export.layer_q(tiny.config, tiny.weights.layers[0], plan, 0)
    spec = export.SegmentSpec(0, "qkv", ("qkv",), 16, "cpu", emit_x=True)
    g, _ = prepare_graph(spec, lq, tiny.fingerprint, OrtCpuLane())
    h = torch.randn(16, 64) * 3
    out = g.run({"h": h})
    x = out["x"].numpy()
    want = np.concatenate([int8_linear(x, 0.02, plan.weights[(0, n)]) for n in ("wq", "wk", "wv")], axis=1)
    assert np.array_equal(out["qkv"].numpy(), want)


@pytest.mark.parametrize("shadow", [None, SHADOWS], ids=["plain", "shadows"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_layers_match_reference(shadow, arch):
    # Whole layer vs the reference: the int part is exact; float ops (RMSNorm, SiLU) are computed by ORT
    # instead of torch, which may differ by float32 rounding (a few ulps of |h| ≲ 10 → 1e-5 absolute).
    m = make_tiny_model(arch)
    plan = tiny_plan(m, shadow)
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
