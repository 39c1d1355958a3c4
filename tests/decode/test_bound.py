"""The bound one-token step (`decode.bound_step`) computes what the unbound graphs + `model.attention` compute,
bit for bit, on every quantized plan shape: shadow cuts at every site, W8A16 sites with online Hadamards, and
each weight form this CPU runs exactly; and a tree row verified in a chunk equals the plain step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero import model as ref
from hetero.decode.rowattn import row_attention
from hetero.decode.step import DECODE_THREADS, DecodeStep
from hetero.decode.tree import TokenTree
from hetero.errors import ConfigError
from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model
from tests.npu.conftest import SHADOWS, tiny_plan
from tests.npu.test_site_ops import FORMS, rotated_a16_plan


@pytest.fixture(autouse=True)
def graph_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))


def plans(m, form: str) -> dict:
    shadows = dict(SHADOWS)
    shadows[(0, "o_in")] = (2,)
    return {"w8a8-shadows": tiny_plan(m, shadows), "rot-a16-shadows": rotated_a16_plan(m, form, ("down_in",), SHADOWS)}


@torch.inference_mode()
def unbound_step(rt: Runtime, be: NpuBackend, cache, token: int, slot: int) -> np.ndarray:
    """The reference: the C = 1 backend's qkv / o_ffn (numpy, bound per run) around `model.attention` (torch, on
    views of the numpy cache); the hidden rows [1, hidden] as numpy."""
    h = ref.embed(rt.model.weights, torch.tensor([token])).numpy()
    for layer in range(rt.cfg.n_layers):
        q, k, v = (torch.from_numpy(x) for x in be.qkv(layer, h))
        kc, vc = (torch.from_numpy(x) for x in cache.layer(layer))
        a = ref.attention(rt.cfg, q, k, v, rt.rope, kc, vc, slot, 1, torch.tensor([slot]), None, row_attention)
        h = be.o_ffn(layer, a.contiguous().numpy(), h)
    return h


@pytest.mark.parametrize("attention_threads", [1, 2])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["w8a8-shadows", "rot-a16-shadows"])
def test_bound_step_equals_the_unbound_graphs_and_a_tree_row(form, kind, attention_threads):
    m = make_tiny_model()
    plan = plans(m, form)[kind]
    rt = Runtime(m, chunk=16, backend=NpuBackend(m, plan, 16, provider="cpu"))
    step = DecodeStep(rt, attention_threads=attention_threads, split_after=0)  # 2: the KV heads shared with a helper (`attnpool`)
    whole = rt.backend.at_chunk(1, DECODE_THREADS)  # the same graphs, whole (with 2 threads the step runs them split)
    prompt = np.arange(3, 40) * 5 % 256
    r1, r2, r3 = rt.prefill(prompt), rt.prefill(prompt), rt.prefill(prompt)
    slot = r1.cache.length
    for token in (7, 200):  # two steps: the second reads the first's K/V
        if attention_threads == 2 and token == 200:
            step.pool._off = 1  # the contention guard's case: the whole graphs on this thread
        got = step.forward(r1.cache, TokenTree([token], [-1]))
        if attention_threads == 2:  # a one-row step beside the helper runs the graphs split (`halves`)
            assert step._bound[1].stages is not None and any(r.stages for rs in step._bound[1].runs for r in rs)
        h = unbound_step(rt, whole, r2.cache, token, r2.cache.length)
        np.testing.assert_array_equal(got, step.head(h))
        tree = step.forward(r3.cache, TokenTree([token, 9, 11], [-1, 0, 0]))  # root + two siblings
        np.testing.assert_array_equal(got[0], tree[0])
        for c in (r2.cache, r3.cache):
            np.testing.assert_array_equal(r1.cache.k[:, :, slot], c.k[:, :, slot])
            np.testing.assert_array_equal(r1.cache.v[:, :, slot], c.v[:, :, slot])
        for r in (r1, r2, r3):
            r.cache.advance(1)
        slot += 1


def test_decode_step_threads_reach_its_sessions_and_torch_is_restored():
    """The INT8 decode step runs on `threads` (its graph sessions and torch while it runs); torch's count
    outside the step is left as it was. Bad counts are refused."""
    m = make_tiny_model()
    rt = Runtime(m, chunk=16, backend=NpuBackend(m, tiny_plan(m, SHADOWS), 16, provider="cpu",
                                                 options=GraphOptions(intra_op_threads=2)))
    step = DecodeStep(rt, threads=1)
    before = torch.get_num_threads()
    r = rt.prefill(np.arange(3, 20))
    step.forward(r.cache, TokenTree([7], [-1]))
    assert torch.get_num_threads() == before
    be = step.backend(1)
    assert be is not rt.backend and be.provider.intra_op_threads == 1
    assert all(g.session.get_session_options().intra_op_num_threads == 1 for layer in be.layers for g in (r.graph for r in be.program(layer).runs))
    assert rt.backend.provider.intra_op_threads == 2  # the prefill lane keeps its own
    with pytest.raises(ConfigError, match="threads"):
        DecodeStep(rt, threads=0)
    with pytest.raises(ConfigError, match="attention_threads"):
        DecodeStep(rt, attention_threads=3)


def test_shadow_rows_are_each_rows_own_correction():
    """A tree's rows get the shadow a one-row step computes (`shadow_delta_rows`), bit for bit, whatever outlier
    channels the other rows have; a row without outliers gets zeros."""
    from hetero.outliers.shadow import QuantizedBackend

    m = make_tiny_model()
    plan = tiny_plan(m, SHADOWS)
    qb = QuantizedBackend(m.config, m.weights, plan)
    layer, site = next(k for k, sq in plan.sites.items() if sq.shadow)
    width = m.config.hidden if site != "down_in" else m.config.ffn
    s = plan.sites[(layer, site)].scale
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(0)) * s * 20  # within range, mostly
    x[1] = x[1].clamp(-100 * s, 100 * s)  # row 1: no outlier
    x[0, 5] = 300 * s  # rows 0 and 2: outliers on different channels
    x[2, :3] = -400 * s
    got = qb.shadow_delta_rows(layer, site, x)
    assert got is not None
    for i in range(4):
        alone = qb.shadow_delta(layer, site, x[i : i + 1].clone())
        assert torch.equal(got[i], alone[0]) if alone is not None else not got[i].any()
    assert qb.shadow_delta_rows(layer, site, x[1:2]) is None


def test_shadow_rows_with_an_online_transform_near_the_range_edge():
    """With an online transform the range check of all rows rounds unlike one row alone: rows inside the range by
    less than its margin, at the edge or just beyond it still get exactly their one-row correction (or none)."""
    from hetero.outliers.rotate import block_hadamard
    from hetero.outliers.shadow import QuantizedBackend

    m = make_tiny_model()
    plan = rotated_a16_plan(m, FORMS[0], ("down_in",), SHADOWS)
    qb = QuantizedBackend(m.config, m.weights, plan)
    layer, site = next(k for k, sq in plan.sites.items() if sq.shadow and k[1] in plan.online)
    width = m.config.hidden if site != "down_in" else m.config.ffn
    s = plan.sites[(layer, site)].scale
    x = torch.randn(6, width, generator=torch.Generator().manual_seed(1)) * s * 10
    edge = 127 * s
    for i, f in enumerate((1 - 1e-7, 1.0, 1 + 1e-7, 1 - 1e-3), start=1):  # rows 1..4: the largest value near the edge
        y = block_hadamard(x[i : i + 1], plan.online[site])
        x[i] *= edge * f / y.abs().max()
    x[5, 3] = 500 * s  # a clear outlier
    got = qb.shadow_delta_rows(layer, site, x)
    assert got is not None
    for i in range(6):
        alone = qb.shadow_delta(layer, site, x[i : i + 1].clone())
        assert torch.equal(got[i], alone[0]) if alone is not None else not got[i].any()
