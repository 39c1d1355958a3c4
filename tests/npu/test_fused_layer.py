"""Whole-layer graphs (`GraphOptions.fused`): one ONNX Runtime run per layer and chunk, attention and shadow
corrections inside, against the segmented graphs + `ChunkAttention` (the same plan)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero.npu.nodes import LAYER_PLACEMENT
from hetero.errors import ConfigError
from hetero.weights import SITES
from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.outliers.plan import plan_from_scales
from hetero.runtime import Runtime, SerialExecutor
from tests.conftest import make_tiny_model
from tests.npu.conftest import SHADOWS, tiny_plan


def fused_runtime(model, plan, chunk: int) -> Runtime:
    be = NpuBackend(model, plan, chunk, options=GraphOptions(fused=True))
    return Runtime(model, chunk=chunk, backend=be, executor=SerialExecutor(model.config.n_layers, LAYER_PLACEMENT))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("shadow", [None, SHADOWS], ids=["plain", "shadows"])
def test_fused_layers_equal_the_segments(arch, shadow):
    m = make_tiny_model(arch)
    plan = tiny_plan(m, shadow, scale=0.03)
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(0))
    got = fused_runtime(m, plan, 32).prefill(ids)
    want = Runtime(m, chunk=32, backend=NpuBackend(m, plan, 32)).prefill(ids)
    # the same INT8 products; float ops (shadow matmul, Hadamard, attention) in other kernels: rounding only
    np.testing.assert_allclose(got.logits, want.logits, rtol=0, atol=1e-4)
    for t in ("k", "v"):
        np.testing.assert_allclose(getattr(got.cache, t)[:, :, :70], getattr(want.cache, t)[:, :, :70], rtol=0, atol=1e-4)


def test_in_graph_shadow_finds_the_run_time_outliers(tiny):
    """A site with a shadow corrects exactly the channels beyond its range in this chunk (none: a zero product)."""
    every = {(0, "attn_in"): (0,), (0, "o_in"): (0,), (0, "down_in"): (0,), (1, "attn_in"): (0,), (1, "ffn_in"): (0,)}
    plan = tiny_plan(tiny, every, scale=0.01)
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(3))
    got = fused_runtime(tiny, plan, 32).prefill(ids)
    want = Runtime(tiny, chunk=32, backend=NpuBackend(tiny, plan, 32)).prefill(ids)
    np.testing.assert_allclose(got.logits, want.logits, rtol=0, atol=1e-4)
    clipped = tiny_plan(tiny, None, scale=0.01)  # the same scales without the shadows: a different answer
    other = Runtime(tiny, chunk=32, backend=NpuBackend(tiny, clipped, 32)).prefill(ids)
    assert np.abs(other.logits - want.logits).max() > 1e-2


def test_fused_continues_a_cache_and_decodes(tiny):
    plan = tiny_plan(tiny, SHADOWS, scale=0.03)
    ids = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(2))
    rt, ref = fused_runtime(tiny, plan, 16), Runtime(tiny, chunk=16, backend=NpuBackend(tiny, plan, 16))
    a, b = rt.prefill(ids[:30]), ref.prefill(ids[:30])
    got, want = rt.prefill(ids[30:], a.cache), ref.prefill(ids[30:], b.cache)
    np.testing.assert_allclose(got.logits, want.logits, rtol=0, atol=1e-4)
    seg = rt.backend.at_chunk(4, 1)  # decode steps run the same plan's segments
    assert not seg.fused and seg.at_chunk(8, 1) is seg and rt.backend.at_chunk(4, 1) is seg


def test_fused_refuses_what_it_cannot_run():
    m = make_tiny_model()
    plan = tiny_plan(m)
    with pytest.raises(ConfigError, match="whole-layer graphs need"):
        NpuBackend(m, plan, 16, options=GraphOptions(fused=True, dynamic_rows=False))
    seg = NpuBackend(m, plan, 16)
    fused = NpuBackend(m, plan, 16, options=GraphOptions(fused=True))  # its segments: a layer-by-layer forward
    h = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).numpy()
    for got, want in zip(fused.qkv(1, h), seg.qkv(1, h)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(fused.o_ffn(1, h, h), seg.o_ffn(1, h, h))
    z = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    with pytest.raises(ConfigError, match="runs segments"):
        seg.layer(0, z(4, 64), z(2, 32, 16), z(2, 32, 16), 0, (z(32, 8),) * 2, z(4, 64))
    with pytest.raises(ConfigError, match="the key cache must be a C-contiguous float32"):  # a strided view
        fused.layer(0, z(4, 64), z(2, 32, 32)[:, :, :16], z(2, 32, 16), 0, (z(32, 8),) * 2, z(4, 64))


@pytest.mark.parametrize("form", ["w8-u8u8", "w8-u8s8"])
def test_fused_layers_equal_the_segments_in_each_weight_form(form):
    """Both CPU kernels (u8·u8 on AVX2, u8·s8 with VNNI) run inside whole-layer graphs as in the segments."""

    m = make_tiny_model()
    plan = plan_from_scales(m, {(l, s): 0.03 for l in range(m.config.n_layers) for s in SITES}, SHADOWS,
                            weight_form=form)
    assert plan.weight_form == form
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5))
    got = fused_runtime(m, plan, 32).prefill(ids)
    want = Runtime(m, chunk=32, backend=NpuBackend(m, plan, 32)).prefill(ids)
    np.testing.assert_allclose(got.logits, want.logits, rtol=0, atol=1e-4)


def _runtime(model, plan, chunk: int, attention: str) -> Runtime:
    be = NpuBackend(model, plan, chunk, options=GraphOptions(fused=True, attention=attention))
    return Runtime(model, chunk=chunk, backend=be, executor=SerialExecutor(model.config.n_layers, LAYER_PLACEMENT))


@pytest.mark.parametrize("shadow,online", [(None, 0), (SHADOWS, 0), (SHADOWS, 32), (SHADOWS, 16)],
                         ids=["plain", "shadows", "rotated", "rotated-blocks"])
def test_bf16_attention_between_two_graphs_equals_the_whole_layer_graph(shadow, online):
    """The BF16 kernel between each layer's two graphs (`segments.layer_halves`) against the one graph with
    ONNX Runtime's fp32 GroupQueryAttention: the same cache rows, logits within bf16 rounding, a continued cache.
    online: a plan with o_in's online Hadamard of one head's size or of blocks of it, which the kernel applies (on V's
    rows)."""
    import dataclasses

    from hetero.native.attention import unavailable
    from hetero.outliers.plan import quantize_weights

    m = make_tiny_model(head_dim=32)
    why = unavailable(m.config)
    if why is not None:
        pytest.skip(f"the BF16 attention kernel cannot run on this host: {why}")
    plan = tiny_plan(m, shadow, scale=0.03)
    if online:
        plan = dataclasses.replace(plan, online={"o_in": online},
                                   weights=quantize_weights(m, "channel", plan.weight_qmax, {"o_in": online}))
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(6))
    got, want = _runtime(m, plan, 32, "bf16"), _runtime(m, plan, 32, "gqa")
    assert got.backend.attention is not None and want.backend.attention is None
    assert [len(got.backend.program(layer).runs) for layer in range(2)] == [2, 2]  # qkv half, o→FFN half
    assert got.backend.program(0).runs[1].graph.spec.a_rotated == bool(online)
    a, b = got.prefill(ids[:40]), want.prefill(ids[:40])
    a, b = got.prefill(ids[40:], a.cache), want.prefill(ids[40:], b.cache)
    for t in ("k", "v"):  # the first layer's K/V rows come from the same INT8 products: fp32 rounding only
        np.testing.assert_allclose(getattr(a.cache, t)[0, :, :70], getattr(b.cache, t)[0, :, :70], rtol=0, atol=1e-5)
    err = np.abs(a.logits - b.logits).max() / np.abs(b.logits).max()
    assert err < 2e-2, err  # bf16 q/k/v/probabilities; a wrong row or mask moves logits by O(1)


def test_attention_option_is_checked():
    m = make_tiny_model()  # head size 16: the BF16 kernel does not take it
    plan = tiny_plan(m)
    with pytest.raises(ConfigError, match="attention must be"):
        NpuBackend(m, plan, 16, options=GraphOptions(fused=True, attention="fast"))
    with pytest.raises(ConfigError, match="head size of 16"):
        NpuBackend(m, plan, 16, options=GraphOptions(fused=True, attention="bf16"))
    auto = NpuBackend(m, plan, 16, options=GraphOptions(fused=True))  # falls back to the in-graph node, saying why
    assert auto.attention is None and "head size of 16" in auto.attention_why


def test_halves_on_addresses_equal_the_checked_calls(monkeypatch):
    """A prefill's halves on the addresses checked once per prompt (`npu.nodes.HalvesAt`) write the same cache rows and
    logits, bit for bit, as the calls that check every buffer; a cache reallocated under them is refused at commit."""
    import time

    from hetero.npu import nodes
    from hetero.npu.nodes import HALF_PLACEMENT
    from hetero.native.attention import unavailable

    m = make_tiny_model(head_dim=32)
    why = unavailable(m.config)
    if why is not None:
        pytest.skip(f"the BF16 attention kernel cannot run on this host: {why}")
    plan = tiny_plan(m, SHADOWS, scale=0.03)
    be = NpuBackend(m, plan, 32, options=GraphOptions(fused=True, attention="bf16"))
    rt = Runtime(m, chunk=32, backend=be, executor=SerialExecutor(m.config.n_layers, HALF_PLACEMENT))
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3))

    def two_turns():
        first = rt.prefill(ids[:40])
        return rt.prefill(ids[40:], first.cache)

    fast = two_turns()
    assert rt.plan(ids[:40]).dag.kinds == ("layer_attn", "layer_ffn")
    with monkeypatch.context() as mp:
        mp.setattr(nodes.HalvesAt, "of", classmethod(lambda cls, backend, job: None))
        slow = two_turns()
    np.testing.assert_array_equal(fast.logits, slow.logits)
    for t in ("k", "v"):
        np.testing.assert_array_equal(getattr(fast.cache, t)[:, :, :70], getattr(slow.cache, t)[:, :, :70])
    assert fast.cache.held_bytes() == slow.cache.held_bytes()

    plan2, cache = rt.plan(ids), rt.new_cache()
    cache.reserve(ids.numel())
    job, run = rt.start(plan2, cache)
    run.step(None)
    cache.k = cache.k.copy()  # what a `reserve` between two slices of the plan would do
    with pytest.raises(ConfigError, match="reallocated during its prefill"):
        rt.commit(job, run.schedule(), time.perf_counter())
