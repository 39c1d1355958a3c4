"""MatMulNBits decode graphs (`npu.nbits`): they compute the float layer within the form's rounding, are cached and
verified like the segments, and a decode step over them equals the unbound graphs bit for bit; the decode
placement runs them for 1-2-row steps and the INT8 graphs for larger trees, and says so."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero import model as ref
from hetero.decode.step import DecodeStep
from hetero.decode.tree import TokenTree
from hetero.errors import ConfigError
from hetero.npu.graph_backend import NpuBackend
from hetero.npu.nbits import DEFAULT_FORM, NBITS_ROWS, NbitsBackend, NbitsForm, quantize_columns, quantize_weight
from hetero.npu.placement import decode_placement
from hetero.npu.providers import OrtCpuProvider
from hetero.outliers.rotate import block_hadamard
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model
from tests.decode.test_bound import unbound_step
from tests.npu.conftest import SHADOWS, tiny_plan
from tests.npu.test_site_ops import FORMS, ONLINE, rotated_a16_plan


def _rel(got, want) -> float:
    """max |got - want| / max |want| of numpy arrays (the backends') or torch tensors (the float reference's)."""
    got, want = np.asarray(got), np.asarray(want)
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_weights_quantized_by_onnx_runtime_round_trip_within_half_a_step():
    w = torch.randn(200, 48, generator=torch.Generator().manual_seed(0)).numpy()  # K = 200: a padded last block
    for form in (NbitsForm(8, 128), NbitsForm(8, 32, symmetric=False), NbitsForm(4, 32)):
        packed, scales, zp = quantize_weight(w, form)
        blocks = -(-200 // form.block)
        assert packed.shape == (48, blocks, form.block * form.bits // 8) and scales.shape == (48, blocks)
        assert (zp is None) == form.symmetric
        if form.bits == 8 and form.symmetric:  # q = packed - 128, w ≈ q·scale per block
            q = packed.astype(float).reshape(48, -1)[:, :200] - 128
            deq = q * scales.repeat(form.block, axis=1)[:, :200]
            assert abs(deq - w.T).max() <= 0.5 * scales.max() + 1e-6


def test_a_weight_quantized_a_block_of_columns_at_a_time_is_the_whole_weights_bit_for_bit():
    """A head or site is quantized in blocks of its output columns (`quantize_columns`: never whole in float32);
    blocks of uneven sizes give the whole weight's packed values, scales and zero points."""
    w = torch.randn(200, 70, generator=torch.Generator().manual_seed(1)).numpy() * np.linspace(0.1, 4, 70, dtype=np.float32)
    for form in (NbitsForm(8, 128), NbitsForm(8, 32, symmetric=False), NbitsForm(4, 32)):
        cuts = [0, 16, 17, 50, 70]
        got = quantize_columns(200, 70, ((slice(a, b), w[:, a:b]) for a, b in zip(cuts, cuts[1:])), form)
        for g, want in zip(got, quantize_weight(w, form)):
            assert (g is None) == (want is None) and (g is None or np.array_equal(g, want))


@pytest.mark.parametrize("online", [False, True])
def test_graphs_compute_the_float_layer_within_the_forms_rounding(online):
    m = make_tiny_model(qkv_bias=True)
    sites = dict(ONLINE) if online else {}
    be = NbitsBackend(m, sites, OrtCpuProvider(1))
    g = torch.Generator().manual_seed(1)
    h, a = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g) * 0.5
    for layer in range(2):  # the backend on numpy (`tensors = "numpy"`), the float reference on torch
        lw = m.weights.layers[layer]
        for got, want in zip(be.qkv(layer, h.numpy()), ref.qkv(m.config, lw, h)):
            assert _rel(got, want) < 0.03
        assert _rel(be.o_ffn(layer, a.numpy(), h.numpy()) - h.numpy(), ref.o_ffn(m.config, lw, a, h) - h) < 0.03
    assert {r.graph.session.get_inputs()[0].name for p in map(be.program, be.layers) for r in p.runs} == {"h", "a"}
    assert all(r.shadow is None for p in map(be.program, be.layers) for r in p.runs)  # no shadow corrections
    assert be.shadow_delta(0, "attn_in", h.numpy()) is None


def test_online_sites_multiply_by_the_transformed_weights():
    """An online site's graph computes (x·T)(W·T)ᵀ = x·Wᵀ: the float layer, not the layer of W·T."""
    m = make_tiny_model()
    be = NbitsBackend(m, dict(ONLINE), OrtCpuProvider(1))
    a = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    h = torch.zeros(2, 64)
    lw = m.weights.layers[0]
    want = ref.o_ffn(m.config, lw, a, h)
    assert _rel(be.o_ffn(0, a.numpy(), h.numpy()), want) < 0.03
    if "o_in" in ONLINE:  # with W (not W·T) behind the transform the output would be far off
        assert _rel(block_hadamard(a, ONLINE["o_in"]) @ lw.wo.T, a @ lw.wo.T) > 0.1


def test_graphs_are_cached_and_a_damaged_entry_is_rebuilt(graph_cache):
    m = make_tiny_model()
    first = NbitsBackend(m, {}, OrtCpuProvider(1), layers=[0])
    assert [i.cached for i in first.report] == [False, False]
    again = NbitsBackend(m, {}, OrtCpuProvider(1), layers=[0])
    assert [i.cached for i in again.report] == [True, True]
    other = NbitsBackend(m, {}, OrtCpuProvider(1), NbitsForm(4, 32), layers=[0])  # another form: other keys
    assert [i.cached for i in other.report] == [False, False]
    path = again.program(0).runs[0].source
    path.write_bytes(path.read_bytes()[:-7] + b"damaged")
    rebuilt = NbitsBackend(m, {}, OrtCpuProvider(1), layers=[0])  # (a warning names the damaged entry)
    assert [i.cached for i in rebuilt.report] == [False, True]
    x = np.random.default_rng(0).standard_normal((1, 64), dtype=np.float32)
    np.testing.assert_array_equal(rebuilt.qkv(0, x)[0], again.qkv(0, x)[0])


def test_form_is_checked():
    with pytest.raises(ConfigError, match="MatMulNBits form"):
        NbitsForm(bits=3)
    with pytest.raises(ConfigError, match="layer 5 was not prepared"):
        NbitsBackend(make_tiny_model(), {}, OrtCpuProvider(1), layers=[0]).program(5)


@pytest.mark.parametrize("attention_threads", [1, 2])
@pytest.mark.parametrize("kind", ["w8a8-shadows", "rot-a16-shadows"])
def test_bound_step_on_nbits_graphs_equals_the_unbound_graphs(kind, attention_threads):
    m = make_tiny_model()
    plan = {"w8a8-shadows": tiny_plan(m, SHADOWS), "rot-a16-shadows": rotated_a16_plan(m, FORMS[0], ("down_in",), SHADOWS)}[kind]
    rt = Runtime(m, chunk=16, backend=NpuBackend(m, plan, 16, provider="cpu"))
    step = DecodeStep(rt, attention_threads=attention_threads, split_after=0, small_rows=NBITS_ROWS, kernel="nbits")
    assert all(isinstance(step.backend(c), NbitsBackend) for c in (1, 2, 8))
    assert step.backend(1) is step.backend(8) and step.backend(1).online == plan.online  # rows symbolic: one set
    assert isinstance(DecodeStep(rt, small_rows=2).backend(4), NpuBackend)  # past small_rows: the INT8 graphs
    whole = NbitsBackend(m, plan.online, OrtCpuProvider(1))
    prompt = np.arange(3, 40) * 5 % 256
    r1, r2 = rt.prefill(prompt), rt.prefill(prompt)
    slot = r1.cache.length
    for token in (7, 200):  # two steps: the second reads the first's K/V
        got = step.forward(r1.cache, TokenTree([token], [-1]))
        h = unbound_step(rt, whole, r2.cache, token, r2.cache.length)
        np.testing.assert_array_equal(got, step.head(h))
        np.testing.assert_array_equal(r1.cache.k[:, :, slot], r2.cache.k[:, :, slot])
        for r in (r1, r2):
            r.cache.advance(1)
        slot += 1


def test_decode_placement_runs_nbits_for_small_steps_and_says_so(monkeypatch):
    """Where hetero's int8 GEMVs cannot run (`native.gemv`: here a CPU without AVX-512 VNNI), the small steps run the
    MatMulNBits graphs, and the placement says why."""
    from hetero.native import gemv

    monkeypatch.setattr(gemv, "unavailable", lambda cfg, build=True: "this CPU lacks avx512_vnni")
    m = make_tiny_model()
    be = NpuBackend(m, tiny_plan(m, SHADOWS), 16, provider="cpu")
    placed = decode_placement(be)
    assert placed.small_rows == NBITS_ROWS and "MatMulNBits" in placed.describe()
    assert DEFAULT_FORM.describe() in placed.describe() and "lacks avx512_vnni" in placed.describe()
    assert placed.small_kernel == "nbits"
    rt = Runtime(m, chunk=16, backend=be, decode=placed)
    step = DecodeStep(rt)
    assert step.small_rows == NBITS_ROWS and isinstance(step.backend(1), NbitsBackend) and step.kernel == "nbits"
    assert step.head.name == "nbits"
    assert f"nbits{NBITS_ROWS}" in step.costs_key  # measured step costs of this form are its own (`stepcosts`)
    assert DecodeStep(rt, small_rows=0).small_rows == 0 and "nbits" not in DecodeStep(rt, small_rows=0).costs_key
    with pytest.raises(ConfigError, match="int8 GEMVs cannot run here: this CPU lacks avx512_vnni"):
        DecodeStep(rt, kernel="gemv")


@pytest.mark.parametrize("tree", [TokenTree([7, 9], [-1, 0]), TokenTree([7, 9, 11, 4, 2], [-1, 0, 0, 1, 3])])
def test_a_tree_row_is_its_plain_step_within_rounding(tree):
    """Each row's activations are quantized alone, but ONNX Runtime's kernel for several rows sums in another order
    than its one-row kernel: a row verified in a token tree differs from its plain step in the last bits only (so
    greedy speculation emits plain greedy's tokens but at numeric ties)."""
    m = make_tiny_model()
    rt = Runtime(m, chunk=16, backend=NpuBackend(m, tiny_plan(m, SHADOWS), 16, provider="cpu"))
    step = DecodeStep(rt, small_rows=NBITS_ROWS, split_after=None, kernel="nbits")
    prompt = np.arange(3, 40) * 5 % 256
    r1, r2 = rt.prefill(prompt), rt.prefill(prompt)
    for token in (7, 200):
        plain = step.forward(r1.cache, TokenTree([token], [-1]))
        rows = step.forward(r2.cache, TokenTree([token] + tree.tokens[1:], tree.parents))
        np.testing.assert_allclose(rows[0], plain[0], rtol=0, atol=1e-4 * float(np.abs(plain).max()))
        for r in (r1, r2):
            r.cache.advance(1)


@pytest.mark.parametrize("form", [DEFAULT_FORM, NbitsForm(8, 32, symmetric=False), NbitsForm(4, 32)])
def test_split_nbits_graphs_compute_the_whole_graphs_outputs_bit_for_bit(form):
    """A one-row MatMulNBits graph cut into column halves (`decode.twocore.halves`, the two-core step) computes the
    whole graph's outputs bit for bit: a column's sum reads only its own weights and the row's int8 blocks."""
    import onnx

    from hetero.decode.twocore.stages import Stages

    m = make_tiny_model(qkv_bias=True)
    be = NbitsBackend(m, dict(ONLINE), OrtCpuProvider(1), form)
    rng = np.random.default_rng(0)
    for layer in be.layers:
        for run in be.program(layer).runs:
            g = run.graph
            ins = {n: rng.standard_normal((1, w)).astype(np.float32) * 3 for n, w in g.inputs.items()}
            outs = {n: np.full((1, w), np.nan, np.float32) for n, w in g.outputs.items()}
            stages = Stages()
            span = stages.add(onnx.load(str(g.path)), ins, outs)
            assert span is not None and sum(h != 0 for h in stages.hs) == sum(
                n.op_type == "MatMulNBits" for n in onnx.load(str(g.path)).graph.node)  # each one a stage of two halves
            stages.table().run_here(*span)
            want = dict(zip([o.name for o in g.session.get_outputs()],
                            g.session.run(None, ins)))
            for name, t in outs.items():
                assert np.array_equal(t, want[name]), f"layer {layer} {g.spec.kind}: {name}"


def test_nbits_head_computes_the_float_logits_and_its_split_halves_the_whole_graphs():
    """The MatMulNBits LM head (`decode.head.NbitsHead`) against the float head, and its vocabulary halves beside the
    helper thread (`split`) against the whole graph, bit for bit."""
    from hetero.decode.head import FloatHead, NbitsHead
    from hetero.decode.twocore.attnpool import AttentionPool

    m = make_tiny_model()
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).numpy() * 2  # heads: numpy h → numpy logits
    want = FloatHead(m.config, m.weights)(h)
    whole = NbitsHead(m.config, m)
    got = whole(h)
    assert got.shape == want.shape and _rel(got, want) < 0.03
    pool = AttentionPool()
    try:
        split = NbitsHead(m.config, m, pool=pool)
        assert split.split() and split.split()  # (once made, kept)
        for row in h:
            np.testing.assert_array_equal(split(row[None]), whole(row[None]))
        np.testing.assert_array_equal(split(h), got)  # more rows: the whole graph
    finally:
        pool.close()
