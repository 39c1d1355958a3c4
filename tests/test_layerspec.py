"""The layer spec (`hetero.layerspec`): what a method refuses is derived from what each writing of the layer registers."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hetero import layerspec
from hetero.config import ModelConfig
from hetero.errors import ConfigError
from hetero.layerspec import WRITINGS, LayerSpec, lacks, refusal
from hetero.methods import DEFAULT_METHOD, METHODS, make_runtime
from tests.conftest import make_tiny_model
from tests.test_architectures import CASES
from tests.tiny_hf import ARCHS, config_of

ROOT = Path(__file__).resolve().parents[1]
FAST_PATHS = ("BF16 attention kernel", "GroupQueryAttention node", "decode GEMV step", "native glue ops")


def _with_foo(cfg: ModelConfig) -> LayerSpec:
    """`cfg`'s spec with a field added that no writing registers: `foo`, set."""
    foo = dataclasses.make_dataclass("FooSpec", [("foo", bool, False)], bases=(LayerSpec,), frozen=True)
    plain = LayerSpec.of(cfg)
    return foo(**{f.name: getattr(plain, f.name) for f in dataclasses.fields(LayerSpec)}, foo=True)


def test_a_feature_no_writing_registers_makes_every_method_refuse_naming_it(monkeypatch) -> None:
    """A field added to the spec is a feature with no other edit; no writing registers it, so every quantized method
    refuses naming it and every writing it runs, and so does float (the torch reference does not register it either),
    and each fast path gives way."""
    from hetero.attention import gqa_supported
    from hetero.native import attention, gemv
    from hetero.npu.graph_backend import native_ops_why

    m = make_tiny_model(head_dim=32)
    spec = _with_foo(m.config)
    assert spec.features() == {"foo": True, "kv_group": 2} and spec.part("foo") is None
    monkeypatch.setattr(LayerSpec, "of", staticmethod(lambda cfg: spec))
    quantized = [name for name, method in METHODS.items() if method.recipe is not None]
    assert len(quantized) >= 10
    for name, method in METHODS.items():
        with pytest.raises(ConfigError, match=r"\bfoo=True \(not in: ") as e:
            make_runtime(m, name, chunk=32, threads=1)
        listed = re.search(r"not in: ([^)]*)\)", str(e.value)).group(1).split(", ")
        # the default runs a model the INT8 path refuses in float, which refuses it too
        runs = METHODS["float"] if name == DEFAULT_METHOD else method
        assert set(listed) == set(runs.writings), name
    assert m.config.quantized_unsupported().startswith("foo=True (not in: ")
    with pytest.raises(ConfigError, match="foo=True"):
        m.config.check_quantizable("quantization")
    for lacking in (attention.config_unsupported(m.config), gqa_supported(m.config), gemv.config_unsupported(m.config),
                    native_ops_why(m.config, {"down_in": 64}, object(), None)[1]):
        assert "foo=True" in lacking


def _before(cfg: ModelConfig) -> tuple[bool, bool, bool, bool]:
    """Whether the BF16 kernel, the GroupQueryAttention node, the GEMV step and the glue ops lacked a feature of `cfg`,
    as the hand-written checks decided before the registry (shape limits apart: they stay checks of their own), less
    what a writing has computed since (the BF16 kernel: QK-norm, the local RoPE base and partial rotary; the GEMV
    step: GELU-tanh, ReLU and post-norms, where the erf GELU stays a check of its own; the glue ops: other activations
    and post-norms, left to ONNX Runtime's nodes)."""
    return (False,
            cfg.qk_norm or bool(cfg.local_rope_theta), False, False)


@pytest.mark.parametrize("arch,fields", [(a, {}) for a in ARCHS] + [(a, f) for _, a, f in CASES],
                         ids=[f"tiny-{a}" for a in ARCHS] + [c[0] for c in CASES])
def test_each_architecture_runs_what_it_ran_before(arch, fields) -> None:
    """Every tiny architecture (and each variant `test_architectures` checks against transformers) is accepted by
    every method, as the hand list accepted every variant, and each fast path takes the models it took."""
    cfg = ModelConfig.from_hf(config_of(arch, **{k: v for k, v in fields.items() if v is not None}).to_dict())
    spec = LayerSpec.of(cfg)
    assert cfg.quantized_unsupported() is None
    for name, method in METHODS.items():
        assert refusal(spec, method.writings) is None, name
    assert tuple(lacks(spec, w) is not None for w in FAST_PATHS) == _before(cfg)


def test_the_spec_of_a_config_names_its_features() -> None:
    cfg = ModelConfig.from_hf(config_of("gemma3").to_dict())
    got = LayerSpec.of(cfg).features()
    assert {"embed_scale", "act", "post_norms", "qk_norm", "local_rope_theta", "windows", "attn_scale"} <= set(got)
    assert got["windows"] == cfg.windows and not {"qkv_bias", "rotary_dim"} & set(got)
    plain = ModelConfig(arch="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=4, ffn=96, vocab=256,
                        context_length=64, rms_eps=1e-5, rope_theta=10000.0)
    assert LayerSpec.of(plain).features() == {}


def test_each_registration_names_its_module_and_an_existing_test() -> None:
    for w in WRITINGS.values():
        assert (ROOT / (w.module.replace(".", "/") + ".py")).is_file(), w
        assert w.tests, w
        for test in w.tests:
            path, _, name = test.partition("::")
            assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), test
    text = (ROOT / "docs" / "design.md").read_text()
    missing = [n for n in WRITINGS if f"| {n} |" not in text]
    assert not missing, f"docs/design.md's table of writings lacks {missing}"
    for names in (layerspec.FLOAT, layerspec.INT8):
        assert all(n in WRITINGS for n in names)


def test_a_registration_of_what_the_spec_does_not_have_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(layerspec, "WRITINGS", dict(WRITINGS))
    with pytest.raises(ValueError, match="unknown"):
        layerspec.register("x", "hetero.model", ("dense",), ("softcap",), "tests/test_layerspec.py")
    with pytest.raises(ValueError, match="outside its parts"):
        layerspec.register("x", "hetero.model", ("dense",), ("qk_norm",), "tests/test_layerspec.py")
    with pytest.raises(ValueError, match="already registered"):
        layerspec.register("nbits", "hetero.npu.nbits", ("dense",), (), "tests/test_layerspec.py")
    with pytest.raises(ValueError, match="no test holds it"):
        layerspec.register("x", "hetero.model", ("dense",), ("act",))
    with pytest.raises(ValueError, match="no writing"):
        refusal(LayerSpec(qk_norm=True), ("a writing nobody registered",))


# The registrations no other test holds: each such writing on tiny models with the features it registers, against the
# float reference, and the feature shown to matter (the reference without it differs by more than the tolerance).

def _built(tmp_path, monkeypatch, arch: str, **fields):
    from hetero.loader import load_model
    from tests.tiny_hf import build

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    build(arch, tmp_path / "hf", **fields)
    return load_model(tmp_path / "hf")


def _rel(got, want) -> float:
    got, want = np.asarray(got), np.asarray(want)
    return float(np.abs(got - want).max() / np.abs(want).max())


BIASED = dict(attention_bias=True, mlp_bias=True)


def _unbiased(m):
    """`m` without its o_proj and MLP biases (the layer adds the biases its weights hold), under its own fingerprint."""
    layers = [dataclasses.replace(lw, bo=None, b_gate=None, b_up=None, b_down=None) for lw in m.weights.layers]
    return m.with_weights(dataclasses.replace(m.weights, layers=layers), fingerprint=f"{m.fingerprint}-unbiased")


@pytest.mark.parametrize("arch,fields", [("llama", {**BIASED, "hidden_act": "gelu_pytorch_tanh"}), ("gemma3", {})],
                         ids=["biases-gelu", "gemma3"])
def test_nbits_graphs_compute_the_dense_features_they_register(tmp_path, monkeypatch, arch, fields) -> None:
    from hetero import model as ref
    from hetero.npu.nbits import NbitsBackend
    from hetero.npu.providers import OrtCpuProvider

    m = _built(tmp_path, monkeypatch, arch, **fields)
    cfg = m.config
    dense = set(LayerSpec.of(cfg).features()) & {"qkv_bias", "o_bias", "mlp_bias", "act", "post_norms"}
    assert dense >= ({"act", "post_norms"} if arch == "gemma3" else {"qkv_bias", "o_bias", "mlp_bias", "act"})
    assert dense <= WRITINGS["nbits"].computes
    plain = dataclasses.replace(cfg, o_bias=False, mlp_bias=False, act="silu", post_norms=False)
    be = NbitsBackend(m, {}, OrtCpuProvider(1))
    g = torch.Generator().manual_seed(1)
    h, a = torch.randn(3, cfg.hidden, generator=g), torch.randn(3, cfg.q_dim, generator=g) * 0.5
    for layer, (lw, plain_lw) in enumerate(zip(m.weights.layers, _unbiased(m).weights.layers)):
        for got, want in zip(be.qkv(layer, h.numpy()), ref.qkv(cfg, lw, h)):
            assert _rel(got, want) < 0.03
        got, want = be.o_ffn(layer, a.numpy(), h.numpy()) - h.numpy(), ref.o_ffn(cfg, lw, a, h) - h
        assert _rel(got, want) < 0.03 < _rel(ref.o_ffn(plain, plain_lw, a, h) - h, want)


def _qk_norm_scaled():
    """The tests' tiny QK-norm model with an embedding scale."""
    from tests.test_architectures import _qk_norm_tiny

    m = _qk_norm_tiny()  # the scale in both the config (what the runtime reads) and the weights (`model.embed`'s)
    return m.with_weights(dataclasses.replace(m.weights, embed_scale=1.5),
                          config=dataclasses.replace(m.config, embed_scale=1.5), fingerprint=f"{m.fingerprint}-scaled")


def _ffn_louder(m, by: float = 4.0):
    """`m` with its post-FFN norms' weights times `by`: the FFN's share of the residual stream, and so its activation's
    share of the logits, larger (in the tiny random model GELU-tanh for SiLU moves the logits by 2%, here by 9%)."""
    layers = [dataclasses.replace(lw, post_ffn_norm=lw.post_ffn_norm * by) for lw in m.weights.layers]
    return m.with_weights(dataclasses.replace(m.weights, layers=layers), fingerprint=f"{m.fingerprint}-ffn{by}")


@pytest.mark.parametrize("variant", ["qk_norm-embed_scale", "biases", "gemma3"])
def test_the_gemv_step_computes_the_features_it_registers(tmp_path, monkeypatch, variant) -> None:
    """A decode step on hetero's GEMVs follows the float model where it has each registered feature, and a model
    without the feature does not (Gemma 3: its GELU-tanh and its post-norms, each)."""
    from hetero import model as ref
    from hetero.decode.step import DecodeStep
    from hetero.decode.tree import TokenTree
    from hetero.native import gemv
    from hetero.npu.graph_backend import NpuBackend
    from hetero.npu.placement import decode_placement
    from hetero.runtime import Runtime
    from tests.npu.conftest import SHADOWS, tiny_plan

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    m = {"qk_norm-embed_scale": _qk_norm_scaled, "biases": lambda: _built(tmp_path, monkeypatch, "llama", **BIASED),
         "gemma3": lambda: _ffn_louder(_built(tmp_path, monkeypatch, "gemma3", intermediate_size=128))}[variant]()
    cfg = m.config
    if gemv.unavailable(cfg) is not None:
        pytest.skip(f"hetero's int8 GEMVs cannot run here: {gemv.unavailable(cfg)}")
    spec = LayerSpec.of(cfg)
    features = {k for k in spec.features() if spec.part(k) in WRITINGS["decode GEMV step"].parts} - {"kv_group"}
    assert features == {"qk_norm-embed_scale": {"qk_norm", "embed_scale"}, "biases": {"qkv_bias", "o_bias", "mlp_bias"},
                        "gemma3": {"qk_norm", "embed_scale", "act", "post_norms"}}[variant]
    assert features <= WRITINGS["decode GEMV step"].computes and WRITINGS["decode GEMV step"].lacks(spec) is None
    be = NpuBackend(m, tiny_plan(m, SHADOWS), 16, provider="cpu")
    rt = Runtime(m, chunk=16, backend=be, decode=decode_placement(be))
    step = DecodeStep(rt, split_after=0)
    assert step.kernel == "gemv"
    prompt = np.arange(3, 40) * 5 % cfg.vocab
    got = step.forward(rt.prefill(prompt).cache, TokenTree([7], [-1]))[0]
    ids = torch.tensor([*prompt, 7])
    # the float model without each feature (the embedding scale and the biases the reference reads from the weights)
    without = {"qk_norm-embed_scale": [(dataclasses.replace(cfg, qk_norm=False), m.weights),
                                       (cfg, dataclasses.replace(m.weights, embed_scale=1.0))],
               "biases": [(dataclasses.replace(cfg, o_bias=False, mlp_bias=False), _unbiased(m).weights)],
               "gemma3": [(dataclasses.replace(cfg, act="silu"), m.weights),
                          (dataclasses.replace(cfg, post_norms=False), m.weights)]}[variant]
    with torch.inference_mode():
        want = ref.forward(cfg, m.weights, ids)[0][-1].numpy()
        others = [ref.forward(c, w, ids)[0][-1].numpy() for c, w in without]
    # the INT8 step's error, at least 4x below what leaving out any one feature would cost (measured: 0.4% against
    # 3.8% for QK-norm, 2.5% against 20% for the biases, 1.8% against 8.9% for GELU-tanh)
    err = _rel(got, want)
    assert err < 0.05 and 4 * err < min(_rel(other, want) for other in others), (err, [_rel(o, want) for o in others])


def test_the_glue_ops_compute_the_biases_they_register(tmp_path, monkeypatch) -> None:
    from hetero.native import attention, ort_ops
    from tests.npu.test_ort_ops import _rotated, _runtime

    m = _built(tmp_path, monkeypatch, "llama", hidden_size=128, head_dim=32, intermediate_size=256, **BIASED)
    why = ort_ops.unavailable() or attention.unavailable(m.config)
    if why is not None:
        pytest.skip(f"the glue ops or the BF16 kernel cannot run here: {why}")
    features = set(LayerSpec.of(m.config).features()) - {"kv_group"}
    assert features == {"qkv_bias", "o_bias", "mlp_bias"} and features <= WRITINGS["native glue ops"].computes
    plan = _rotated(m)
    got, want = _runtime(m, plan, True), _runtime(m, plan, False)
    assert got.backend.native_ops and not want.backend.native_ops
    ids = torch.randint(0, m.config.vocab, (70,), generator=torch.Generator().manual_seed(7))
    a, b = got.prefill(ids), want.prefill(ids)
    assert _rel(a.logits, b.logits) < 1e-2  # rounding of the Hadamard's sums and SiLU (`tests/npu/test_ort_ops.py`)
    plain = _unbiased(m)
    assert _rel(_runtime(plain, _rotated(plain), True).prefill(ids).logits, b.logits) > 1e-2


@pytest.mark.parametrize("wide", ["a16", "rows"])
def test_the_glue_ops_compute_gemma3s_layer(tmp_path, monkeypatch, wide: str) -> None:
    """Gemma 3's layer (GeGLU, post-norms, online Hadamards at attn_in, ffn_in and down_in; at attn_in and down_in
    W8A16, or a scale per row as its default recipe) through the halves with hetero's ops: each rotated site's input
    quantized by `HadamardQuant(16)` or `HadamardRowQuant`, the activation and post-norms left to ONNX Runtime's
    nodes; the logits of the graphs without the ops, up to the Hadamard's float rounding, and the ops' graphs hold no
    MatMul of a Hadamard."""
    import onnx

    from hetero.native import attention, ort_ops
    from hetero.outliers.plan import quantize_weights
    from hetero.outliers.rotate import online_sites, rotate_model
    from tests.npu.conftest import tiny_plan
    from tests.npu.test_ort_ops import _runtime

    m = _built(tmp_path, monkeypatch, "gemma3", intermediate_size=128, head_dim=32)
    why = ort_ops.unavailable() or attention.unavailable(m.config)
    if why is not None:
        pytest.skip(f"the glue ops or the BF16 kernel cannot run here: {why}")
    assert {"act", "post_norms"} <= set(LayerSpec.of(m.config).features()) & WRITINGS["native glue ops"].computes
    rm = rotate_model(m, cache=False)
    online = online_sites(m.config)
    base = tiny_plan(rm, None, scale=0.03)
    wider = dict(scale=4 / 32767, bits=16) if wide == "a16" else dict(per_row=True)
    sites = {k: dataclasses.replace(sq, shadow_channels=(), n_hot=0, **wider)
             if k[1] in ("attn_in", "down_in") else sq for k, sq in base.sites.items()}
    plan = dataclasses.replace(base, sites=sites, online=online,
                               weights=quantize_weights(rm, "channel", base.weight_qmax, online))
    got, want = _runtime(rm, plan, True), _runtime(rm, plan, False)
    assert got.backend.native_ops and not want.backend.native_ops
    qkv, o_ffn = ([n.op_type for n in onnx.load(run.graph.path, load_external_data=False).graph.node]
                  for run in got.backend.program(1).runs)
    op = ort_ops.HADAMARD_QUANT16 if wide == "a16" else ort_ops.HADAMARD_ROW_QUANT
    assert op in qkv and "MatMul" not in qkv, qkv
    assert {ort_ops.HADAMARD_QUANT, op, "Gelu"} <= set(o_ffn) and "MatMul" not in o_ffn, o_ffn
    ids = torch.randint(0, m.config.vocab, (70,), generator=torch.Generator().manual_seed(7))
    a, b = got.prefill(ids), want.prefill(ids)
    assert _rel(a.logits, b.logits) < 1e-2  # the Hadamard's sums in another order: a rounding step here and there
    k_got, k_want = a.cache.k[0, :, :8], b.cache.k[0, :, :8]  # layer 0's q|k|v: through attn_in's op alone
    assert _rel(k_got, k_want) < 1e-3
