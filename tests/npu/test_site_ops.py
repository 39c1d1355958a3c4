"""W8A16 sites and online Hadamards in the graphs equal the torch reference, every weight form."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hetero.weights import SITES
from hetero.npu import isa, segments
from hetero.npu.providers import OrtCpuProvider, prepare_graph
from hetero.outliers.a16 import a16_part, split_bytes
from hetero.outliers.plan import plan_from_scales, quantize_weights
from hetero.outliers.quantize import WEIGHT_FORMS
from hetero.outliers.shadow import QuantizedBackend
from tests.conftest import make_tiny_model
from tests.npu.conftest import SHADOWS, assert_layers_match

# forms exact on this CPU (8-bit u8·s8 needs VNNI; without it only its graph structure is tested elsewhere)
FORMS = [f for f, wf in WEIGHT_FORMS.items() if not wf.needs_vnni or isa.has_vnni()]
ONLINE = {"o_in": 16, "down_in": 64}  # tiny model: head_dim 16, ffn 128


def rotated_a16_plan(m, form: str, a16_sites=("attn_in", "down_in"), shadow=None):
    """A tiny plan with online transforms, W8A16 on `a16_sites` (s = 3/32767) and 8 bits elsewhere."""
    base = plan_from_scales(m, {(l, s): 0.02 for l in range(2) for s in SITES}, shadow, weight_form=form)
    sites = {k: dataclasses.replace(sq, scale=3 / 32767, bits=16, shadow_channels=(), n_hot=0)
             if k[1] in a16_sites else sq for k, sq in base.sites.items()}
    return dataclasses.replace(base, sites=sites, online=dict(ONLINE),
                               weights=quantize_weights(m, "channel", base.weight_qmax, ONLINE))


def test_split_bytes_recombines_to_the_int16_grid():
    x = torch.tensor([[-1e9, -3.0, -1e-4, 0.0, 2.5e-4, 1.0, 3.0, 1e9]])
    hi, lo = split_bytes(x, 1e-4)
    q = 256 * hi + lo
    assert torch.equal(q, torch.clamp(torch.round(x / np.float32(1e-4)), -32768, 32767))
    assert hi.min() >= -128 and hi.max() <= 127 and lo.min() >= 0 and lo.max() <= 255


@pytest.mark.parametrize("form", FORMS)
def test_a16_linear_in_the_graph_is_bit_exact(form):
    m = make_tiny_model()
    plan = rotated_a16_plan(m, form)
    lq = segments.layer_q(m.config, m.arrays(), plan, 0)
    assert lq.qkv[0].x_bits == 16 and dict(lq.online) == ONLINE
    g, _ = prepare_graph(segments.SegmentSpec(0, "qkv", ("qkv",), 16, "cpu", emit_x=True), lq, m.fingerprint,
                         OrtCpuProvider())
    out = g.run({"h": np.random.default_rng(0).standard_normal((16, 64), dtype=np.float32) * 3})
    want = a16_part(torch.from_numpy(out["x"]), 3 / 32767, [plan.weights[(0, n)] for n in ("wq", "wk", "wv")])
    np.testing.assert_array_equal(out["qkv"], torch.cat(want, 1).numpy())


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shadow", [None, SHADOWS], ids=["plain", "shadows"])
def test_rotated_a16_layers_match_reference(form, shadow):
    # online Hadamards on o_in/down_in and W8A16 sites: float ops (RMSNorm, SiLU, the Hadamard MatMul) by ORT
    # vs torch differ by float32 rounding, so a 16-bit activation may move by one step: tolerance 1e-4
    m = make_tiny_model()
    a16 = ("attn_in",) if shadow else ("attn_in", "down_in")  # SHADOWS keeps a down_in shadow on layer 0
    plan = rotated_a16_plan(m, form, a16, {k: v for k, v in (shadow or {}).items() if k[1] not in a16})
    assert_layers_match(m, plan, atol=1e-4)


def test_online_transform_keeps_the_float_product():
    # (x·T)(W·T)ᵀ = x·Wᵀ: with 16-bit sites everywhere, what is left is the INT8 weights' error, the same
    # with and without the online transforms; a transform missing on the activations is far off
    from hetero import model as fm

    m = make_tiny_model()
    rotated = rotated_a16_plan(m, FORMS[0], a16_sites=SITES)
    plain = dataclasses.replace(rotated, online={}, weights=quantize_weights(m, "channel", rotated.weight_qmax))
    broken = dataclasses.replace(rotated, online={})
    g = torch.Generator().manual_seed(0)
    h, a = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g) * 0.5
    want = fm.o_ffn(m.config, m.weights.layers[0], a, h) - h
    err = {n: float((QuantizedBackend(m.config, m.weights, p).o_ffn(0, a, h) - h - want).abs().max())
           for n, p in (("rotated", rotated), ("plain", plain), ("broken", broken))}
    assert err["rotated"] < 2 * err["plain"] and err["rotated"] < 0.25 * err["broken"], err


def test_plan_round_trip_keeps_bits_and_online():
    m = make_tiny_model()
    plan = rotated_a16_plan(m, "w8-u8u8")
    from hetero.outliers.plan import QuantPlan

    back = QuantPlan.from_dict(plan.to_dict(), m)
    assert back.online == ONLINE and back.sites == plan.sites
    assert all(np.array_equal(back.weights[k].q, w.q) for k, w in plan.weights.items())
