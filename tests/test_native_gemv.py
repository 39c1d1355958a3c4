"""hetero's int8 GEMVs (`native.gemv`, AVX-512 VNNI) and the decode steps on them (`decode.gemv_step`): the kernel
against a numpy reference of the same arithmetic and against ONNX Runtime's MatMulNBits on the same weight bytes,
every prologue and epilogue, column parts and rows that do not change a column's bits; the step against the float
layer and the MatMulNBits step, two threads = one, a tree row = its plain step; a CPU without VNNI keeps the graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero import model as ref
from hetero.decode.step import DecodeStep
from hetero.decode.tree import TokenTree
from hetero.errors import ConfigError
from hetero.native import gemv
from hetero.npu.graph_backend import NpuBackend
from hetero.npu.nbits import DEFAULT_FORM, quantize_weight
from hetero.npu.placement import decode_placement
from hetero.outliers.rotate import hadamard
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model
from tests.npu.conftest import SHADOWS, tiny_plan

WHY = gemv.unavailable(make_tiny_model().config)
needs_kernel = pytest.mark.skipif(WHY is not None, reason=f"hetero's int8 GEMVs cannot run here: {WHY}")


def _packed(k: int, n: int, seed: int = 0) -> tuple[gemv.Packed, np.ndarray]:
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) * 0.05
    packed, scales, _ = quantize_weight(w, DEFAULT_FORM)
    return gemv.pack_quantized(packed, scales, k), w


def _reference(x: np.ndarray, p: gemv.Packed) -> np.ndarray:
    """The kernel's arithmetic in float64: x quantized to int8 per block of 32 (amax / 127, round half to even),
    integer dot products with the int8 weights per block, times the activation and weight scales."""
    k = p.k
    blocks = -(-k // gemv.AB)
    wq = gemv.dequantized(p)  # [K, N] = q · s_w per block
    out = np.zeros((x.shape[0], p.n))
    for r, row in enumerate(x.astype(np.float64)):
        for b in range(blocks):
            lo, hi = b * gemv.AB, min(k, (b + 1) * gemv.AB)
            m = np.abs(row[lo:hi]).max()
            s = np.float32(m) / np.float32(127)
            q = np.clip(np.rint(row[lo:hi] * (127.0 / m if m > 0 else 0.0)), -127, 127)
            out[r] += (q @ wq[lo:hi]) * s
    return out


def test_packing_keeps_onnx_runtimes_bytes():
    p, w = _packed(200, 70)  # K = 200: a partial last block and a partial quad-free tail; N = 70: a padded tile
    packed, scales, _ = quantize_weight(w, DEFAULT_FORM)
    want = (packed.astype(np.float64).reshape(70, -1)[:, :200] - 128) * np.repeat(scales, 128, axis=1)[:, :200]
    np.testing.assert_allclose(gemv.dequantized(p), want.T, rtol=1e-6, atol=0)
    assert p.w.shape == (2, 50 * 256) and p.ws.shape == (2, 2, gemv.TILE)
    assert (p.w.shape, p.ws.shape) == gemv.packed_shapes(200, 70)


def test_weights_packed_a_block_of_columns_at_a_time_equal_the_whole_packs(tmp_path, monkeypatch):
    """The decode weights are quantized and packed 64 output columns at a time here (`COLUMN_BLOCK`), written to the
    cache entry a piece at a time, mapped back: the same bytes as each linear (online Hadamards, biases) and the
    head packed whole."""
    from hetero.decode import gemv_step
    from hetero.npu.nbits import site_bias, site_weight
    from hetero.weights import SITE_BIASES, SITE_LINEARS

    m = make_tiny_model(qkv_bias=True)
    online = {"attn_in": 64, "down_in": 32}
    monkeypatch.setattr(gemv_step, "COLUMN_BLOCK", gemv.TILE * m.config.hidden)
    want: dict[str, np.ndarray] = {}
    for layer, lw in enumerate(m.weights.layers):
        for site in gemv_step.SITES:
            w_kn = site_weight(lw, SITE_LINEARS[site], online.get(site, 0))
            p = gemv.pack_quantized(*quantize_weight(w_kn, gemv_step.FORM)[:2], w_kn.shape[0])
            want[f"{layer}.{site}.w"], want[f"{layer}.{site}.ws"] = p.w, p.ws
            if (bias := site_bias(lw, SITE_LINEARS[site], SITE_BIASES[site])) is not None:
                want[f"{layer}.{site}.bias"] = bias
    p = gemv.pack_quantized(*quantize_weight(m.weights.lm_head.numpy().T.copy(), gemv_step.FORM)[:2], m.config.hidden)
    want["head.w"], want["head.ws"] = p.w, p.ws
    assert "0.attn_in.bias" in want and want["0.ffn_in.w"].shape[0] == 4  # biases; a site of 4 blocks of columns

    got = gemv_step._packed(m, online).arrays()
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))  # a cached model: the file written piece by piece, mapped
    entry = tmp_path / "models" / m.fingerprint
    entry.mkdir(parents=True)
    (entry / "weights.safetensors").write_bytes(b"the float copy")
    weights = gemv_step.GemvWeights(m, online)
    (path,) = entry.glob("gemv8-*.safetensors")
    assert path.read_bytes()[8:].startswith(b'{"__metadata__"')
    for name, p in weights.linears.items():
        assert np.array_equal(p.w, want[f"{name}.w"]) and np.array_equal(p.ws, want[f"{name}.ws"])
    assert all(np.array_equal(b, want[f"{name}.bias"]) for name, b in weights.biases.items())
    assert weights.biases.keys() == {f"{i}.attn_in" for i in range(m.config.n_layers)}


@needs_kernel
@pytest.mark.parametrize("k,n,rows", [(64, 64, 1), (200, 70, 3), (576, 960, 1), (1536, 576, 8)])
def test_kernel_computes_the_reference_arithmetic(k, n, rows):
    p, w = _packed(k, n, seed=k + n)
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    x[:, 3] *= 40  # an outlier channel: it coarsens its own block only
    out = np.full((rows, n), np.nan, np.float32)
    gemv.run(gemv.bind(p, x, out, gemv.Scratch(rows, k)))
    want = _reference(x, p)
    assert np.abs(out - want).max() <= 2e-6 * np.abs(want).max()
    plain = np.delete(np.arange(k), 3)  # and the float product within the form's rounding (the outlier's block apart)
    x[:, 3] = 0
    out = np.zeros((rows, n), np.float32)
    gemv.run(gemv.bind(p, x, out, gemv.Scratch(rows, k)))
    assert np.abs(out - x[:, plain] @ w[plain]).max() < 0.02 * np.abs(x @ w).max()


@needs_kernel
def test_kernel_matches_onnx_runtimes_matmulnbits_on_the_same_bytes():
    """MatMulNBits at accuracy level 4 over the same 8-bit blocks: the same product up to how each kernel rounds the
    activations (both int8 per block of 128)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    k, n = 576, 192
    _, w = _packed(k, n, seed=3)
    packed, scales, _ = quantize_weight(w, DEFAULT_FORM)
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=8,
                            block_size=128, accuracy_level=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor("w", TensorProto.UINT8, packed.shape, packed.tobytes(), raw=True),
                               helper.make_tensor("s", TensorProto.FLOAT, [scales.size], scales.reshape(-1))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(2).standard_normal((1, k)).astype(np.float32)
    want = sess.run(None, {"x": x})[0]
    out = np.zeros((1, n), np.float32)
    gemv.run(gemv.bind(gemv.pack_quantized(packed, scales, k), x, out, gemv.Scratch(1, k)))
    assert np.abs(out - want).max() < 0.01 * np.abs(want).max()


@needs_kernel
def test_prologues_and_epilogues():
    """RMSNorm of x + add, act(gate)·up (SiLU, GELU-tanh, ReLU), the block Hadamard, bias and residuals: each against
    numpy, the GEMV itself by the reference of its input."""
    rng = np.random.default_rng(4)
    k, n, rows = 128, 64, 2
    p, _ = _packed(k, n, seed=5)
    s = gemv.Scratch(rows, 2 * k)
    x, add = (rng.standard_normal((rows, k)).astype(np.float32) for _ in range(2))
    norm, bias = rng.standard_normal(k).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    r0, r1 = (rng.standard_normal((rows, n)).astype(np.float32) for _ in range(2))
    h = hadamard(64).numpy()

    def check(got: np.ndarray, x_in: np.ndarray, extra: np.ndarray | float = 0.0) -> None:
        want = _reference(x_in, p) + extra
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()

    out = np.zeros((rows, n), np.float32)
    gemv.run(gemv.bind(p, x, out, s, add=add, norm=norm, eps=1e-5, bias=bias, res=(r0, r1)))
    v = x.astype(np.float64) + add
    check(out, v / np.sqrt((v**2).mean(-1, keepdims=True) + 1e-5) * norm, bias + r0.astype(np.float64) + r1)
    gu = rng.standard_normal((rows, 2 * k)).astype(np.float32)
    g, u = gu[:, :k].astype(np.float64), gu[:, k:]
    gates = {"silu": g / (1 + np.exp(-g)), "relu": np.maximum(g, 0),
             "gelu_tanh": 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))}
    assert set(gates) == set(gemv.GATED_ACTS)
    for act, gate in gates.items():
        gemv.run(gemv.bind(p, gu, out, s, gated=act, hadamard=64, res=(r0,)))
        check(out, ((gate * u).reshape(rows, 2, 64) @ h).reshape(rows, k), r0)
        other = gates["relu" if act != "relu" else "silu"]
        assert np.abs(out - (_reference(((other * u).reshape(rows, 2, 64) @ h).reshape(rows, k), p) + r0)).max() > 0.01
    with pytest.raises(ConfigError, match="Hadamard of 48"):
        gemv.bind(p, x, out, s, hadamard=48)
    with pytest.raises(ConfigError, match="must be"):
        gemv.bind(p, x[:, :100], out, s)
    with pytest.raises(ConfigError, match="a gated job takes x alone"):
        gemv.bind(p, gu, out, s, gated="silu", norm=norm)
    with pytest.raises(ConfigError, match="gated must be one of"):
        gemv.bind(p, gu, out, s, gated="gelu")


@needs_kernel
def test_parts_and_rows_do_not_change_a_columns_bits():
    """Two parts claiming tiles from one counter (the two-core step's halves), run one after the other here, and a row
    alone or among eight: the same bits as the whole job."""
    p, _ = _packed(576, 960, seed=6)
    x = np.random.default_rng(7).standard_normal((8, 576)).astype(np.float32)
    whole = np.zeros((8, 960), np.float32)
    gemv.run(gemv.bind(p, x, whole, gemv.Scratch(8, 576)))
    b = gemv.bind(p, x, out := np.full((8, 960), np.nan, np.float32), gemv.Scratch(8, 576))
    counter = np.zeros(8, np.int64)
    halves = b.halves(gemv.Scratch(8, 576), gemv.Scratch(8, 576), counter.ctypes.data)
    lib = gemv.library()
    import ctypes

    lib.hetero_gemv_part(ctypes.addressof(b.job), None, ctypes.addressof(halves[0]))  # takes every tile
    assert counter[0] >= b.tiles
    lib.hetero_gemv_part(ctypes.addressof(b.job), None, ctypes.addressof(halves[1]))  # finds none left
    np.testing.assert_array_equal(out, whole)
    for r in (0, 5):
        one = np.zeros((1, 960), np.float32)
        gemv.run(gemv.bind(p, x[r : r + 1].copy(), one, gemv.Scratch(1, 576)))
        np.testing.assert_array_equal(one[0], whole[r])


def _runtime(online: bool = False):
    m = make_tiny_model(qkv_bias=True)
    plan = tiny_plan(m, SHADOWS)
    if online:
        from tests.npu.test_site_ops import FORMS, rotated_a16_plan

        plan = rotated_a16_plan(m, FORMS[0], ("down_in",), SHADOWS)
    be = NpuBackend(m, plan, 16, provider="cpu")
    return m, Runtime(m, chunk=16, backend=be, decode=decode_placement(be))


@needs_kernel
@pytest.mark.parametrize("online", [False, True])
def test_step_computes_the_float_step_and_the_matmulnbits_steps_logits(online):
    m, rt = _runtime(online)
    step = DecodeStep(rt, split_after=0)
    assert step.kernel == "gemv" and step.head.name == "gemv" and "gemv8" in step.costs_key
    assert rt.decode.small_kernel == "gemv" and "int8 GEMVs" in rt.decode.describe()
    nbits = DecodeStep(rt, split_after=0, kernel="nbits")
    prompt = np.arange(3, 40) * 5 % 256
    r1, r2 = rt.prefill(prompt), rt.prefill(prompt)
    for token in (7, 200):
        got = step.forward(r1.cache, TokenTree([token], [-1]))
        want = nbits.forward(r2.cache, TokenTree([token], [-1]))
        assert np.abs(got - want).max() < 0.03 * np.abs(want).max()
        k1, k2 = r1.cache.k[:, :, r1.cache.length], r2.cache.k[:, :, r2.cache.length]
        assert np.abs(k1 - k2).max() < 0.03 * np.abs(k2).max()
        for r in (r1, r2):
            r.cache.advance(1)
    with torch.inference_mode():  # and the float model's logits of the whole sequence's last token
        ids = torch.tensor(list(prompt) + [7, 200])
        want = ref.forward(m.config, m.weights, ids)[0][-1].numpy()
    assert np.abs(got[0] - want).max() < 0.05 * np.abs(want).max()


@needs_kernel
@pytest.mark.parametrize("tree", [TokenTree([7, 9], [-1, 0]), TokenTree([7, 9, 11, 4, 2], [-1, 0, 0, 1, 3])])
def test_two_threads_equal_one_and_a_tree_row_equals_its_plain_step(tree):
    """The split linears (tiles claimed by both threads) and a row among a tree's rows: bit for bit the one-thread plain
    step, so greedy speculation emits plain greedy's tokens."""
    from hetero.decode.gemv_step import GemvHead, GemvStep

    _, rt = _runtime(online=True)
    two = DecodeStep(rt, split_after=0)
    one = DecodeStep(rt, attention_threads=1)
    assert two.prepare(1).split() and not one.prepare(1).split()
    for c in (1, 2, 8):  # the linears' tiles shared with the helper too (`SPLIT_LINEARS`, off by default)
        two._bound[c] = GemvStep(two._gemv_weights(), rt.model.arrays(), rt.rope, c, two.pool, split=True)
        assert two._bound[c].table.split is not None
    two.head = GemvHead(two._gemv_weights(), two.pool, split=True)
    prompt = np.arange(3, 40) * 5 % 256
    caches = [rt.prefill(prompt).cache for _ in range(3)]
    for token in (7, 200):
        plain = one.forward(caches[0], TokenTree([token], [-1]))
        np.testing.assert_array_equal(two.forward(caches[1], TokenTree([token], [-1])), plain)
        rows = two.forward(caches[2], TokenTree([token] + tree.tokens[1:], tree.parents))
        np.testing.assert_array_equal(rows[0], plain[0])
        for c in caches:
            c.advance(1)


def test_a_cpu_without_vnni_keeps_the_graphs(monkeypatch):
    import hetero.cpu

    monkeypatch.setattr(hetero.cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512bw", "avx512vl"}))
    cfg = make_tiny_model().config
    assert gemv.unavailable(cfg, build=False) == "this CPU lacks avx512_vnni"
    assert gemv.unavailable(cfg) == "this CPU lacks avx512_vnni"
    _, rt = _runtime()
    assert rt.decode.small_kernel == "nbits" and "lacks avx512_vnni" in rt.decode.describe()
    assert DecodeStep(rt).kernel == "nbits"
    with pytest.raises(ConfigError, match="int8 GEMVs cannot run here: this CPU lacks avx512_vnni"):
        DecodeStep(rt, kernel="gemv")
    with pytest.raises(ConfigError, match="GEMV head cannot run here: this CPU lacks avx512_vnni"):
        DecodeStep(rt, head="gemv")


def test_models_the_kernels_do_not_compute_are_named():
    import dataclasses

    cfg = make_tiny_model().config
    assert gemv.config_unsupported(cfg) is None
    for computed in (dict(act="gelu_tanh"), dict(act="relu"), dict(post_norms=True)):
        assert gemv.config_unsupported(dataclasses.replace(cfg, **computed)) is None
    assert gemv.config_unsupported(dataclasses.replace(cfg, act="gelu")) == "act='gelu'"  # the erf form
    assert gemv.unavailable(dataclasses.replace(cfg, act="gelu")).startswith("this model has act='gelu'")
    assert gemv.config_unsupported(dataclasses.replace(cfg, hidden=cfg.hidden + 2)).startswith("a width not a")
