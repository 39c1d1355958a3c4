"""Sites with a scale per row (`outliers.rowscale`): the graphs equal the torch reference bit for bit, the plan
marks the sites importance keeps, HTP's flavours refuse them (they run on the CPU EP only)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hetero.errors import ConfigError
from hetero.weights import SITES
from hetero.npu import isa, segments
from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.npu.providers import OrtCpuProvider, prepare_graph
from hetero.outliers.plan import QuantPlan, plan_from_scales
from hetero.outliers.quantize import WEIGHT_FORMS
from hetero.outliers.rowscale import row_part, row_quantize
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model
from tests.npu.conftest import SHADOWS, assert_layers_match, tiny_plan

FORMS = [f for f, wf in WEIGHT_FORMS.items() if not wf.needs_vnni or isa.has_vnni()]


def per_row_plan(m, sites=tuple(SHADOWS), form: str | None = None) -> QuantPlan:
    """The tiny plan with `sites` per row (no shadows anywhere)."""
    plan = tiny_plan(m, None, scale=0.03) if form is None else plan_from_scales(
        m, {(l, s): 0.03 for l in range(m.config.n_layers) for s in SITES}, None, weight_form=form)
    return dataclasses.replace(plan, sites={k: dataclasses.replace(sq, per_row=True) if k in sites else sq
                                            for k, sq in plan.sites.items()})


def test_row_quantize_uses_each_rows_absmax():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [1000.0, 2.0, -3.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    q, m = row_quantize(x)
    assert m[:, 0].tolist() == [1.0, 1000.0, pytest.approx(1e-30)]
    assert q[0].tolist() == [64.0, -127.0, 32.0, 0.0]  # 63.5 rounds to even; the absmax lands on ±127
    assert q[1].tolist() == [127.0, 0.0, 0.0, 0.0]  # an outlier coarsens only its own row
    assert q[2].abs().sum() == 0


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """What a decode token tree needs: each row's product is the one that row gets alone."""
    m = make_tiny_model()
    w = [per_row_plan(m).weights[(0, "w_down")]]
    x = torch.randn(9, w[0].q.shape[1], generator=torch.Generator().manual_seed(0))
    x[3, 5] = 500.0
    whole = row_part(x, w)[0]
    for i in range(x.shape[0]):
        assert torch.equal(whole[i], row_part(x[i:i + 1], w)[0][0])


@pytest.mark.parametrize("form", FORMS)
def test_per_row_linear_in_the_graph_is_bit_exact(form):
    m = make_tiny_model()
    plan = per_row_plan(m, sites=((0, "attn_in"),), form=form)
    lq = segments.layer_q(m.config, m.arrays(), plan, 0)
    assert lq.qkv[0].x_per_row and not lq.o.x_per_row
    g, _ = prepare_graph(segments.SegmentSpec(0, "qkv", ("qkv",), 16, "cpu", emit_x=True), lq, m.fingerprint,
                         OrtCpuProvider())
    h = np.random.default_rng(0).standard_normal((16, 64), dtype=np.float32)
    h[2, 7], h[5] = 300.0, 0.0  # an outlier row and a row of zeros (RMSNorm: x = 0)
    out = g.run({"h": h})
    want = row_part(torch.from_numpy(out["x"]), [plan.weights[(0, n)] for n in ("wq", "wk", "wv")])
    np.testing.assert_array_equal(out["qkv"], torch.cat(want, 1).numpy())


def test_per_row_layers_match_reference():
    assert_layers_match(make_tiny_model(), per_row_plan(make_tiny_model()), atol=1e-5)


def test_per_row_whole_layer_graphs_equal_the_segments():
    m = make_tiny_model()
    plan = per_row_plan(m)
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(0))
    be = NpuBackend(m, plan, 32, options=GraphOptions(fused=True))
    from hetero.npu.nodes import LAYER_PLACEMENT
    from hetero.runtime import SerialExecutor

    got = Runtime(m, chunk=32, backend=be, executor=SerialExecutor(m.config.n_layers, LAYER_PLACEMENT)).prefill(ids)
    want = Runtime(m, chunk=32, backend=NpuBackend(m, plan, 32)).prefill(ids)
    np.testing.assert_allclose(got.logits, want.logits, rtol=0, atol=1e-4)
    shadowed = Runtime(m, chunk=32, backend=NpuBackend(m, tiny_plan(m, SHADOWS, scale=0.03), 32)).prefill(ids)
    assert np.abs(shadowed.logits - want.logits).max() > 1e-3  # the same sites as shadows: another computation


@pytest.mark.parametrize("flavor", ["qnn", "qnn-fp16"])
def test_htp_flavours_refuse_a_scale_per_row(flavor):
    m = make_tiny_model()
    lq = segments.layer_q(m.config, m.arrays(), per_row_plan(m, sites=((0, "attn_in"),)), 0)
    from hetero.npu.export import build_segment

    with pytest.raises(ConfigError, match="per row runs on the CPU EP"):
        build_segment(segments.SegmentSpec(0, "qkv", ("qkv",), 16, flavor), lq)


def test_plan_round_trip_and_digest_keep_per_row():
    m = make_tiny_model()
    plan = per_row_plan(m)
    back = QuantPlan.from_dict(plan.to_dict(), m)
    assert back.sites == plan.sites and sum(sq.per_row for sq in back.sites.values()) == len(SHADOWS)
    plain = tiny_plan(m, None, scale=0.03)
    assert (segments.layer_digest(segments.layer_q(m.config, m.arrays(), plan, 0))
            != segments.layer_digest(segments.layer_q(m.config, m.arrays(), plain, 0)))
    with pytest.raises(ConfigError, match="per_row"):
        dataclasses.replace(plan.sites[(0, "down_in")], shadow_channels=(1,))


def test_the_default_recipe_scales_rows_and_htp_keeps_shadows():
    from hetero.methods import DEFAULT_METHOD, METHODS, plan_options

    m = make_tiny_model()
    assert plan_options(m, METHODS[DEFAULT_METHOD].recipe, "w8-u8u8").row_scales == ("down_in",)
    assert not plan_options(m, METHODS["hetero-shadow"].recipe, "w8-u8u8").row_scales
    assert METHODS["hetero-qnn"].recipe == METHODS["hetero-shadow"].recipe  # HTP's static graphs: shadows
