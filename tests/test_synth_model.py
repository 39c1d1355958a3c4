"""bench/synth_model.py: seeded synthetic models at real shapes (here its tiny test shapes), an HF folder and a GGUF
of the same weights, that hetero and transformers load, that say they are synthetic, with massive channels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.synth_model import SHAPES, _config, _massive_channels, generate
from hetero.cli import main
from hetero.config import ModelConfig
from hetero.loader import load_model

LINE = "synthetic weights (tiny-llama, seed 0): measures speed and memory, never accuracy"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """tiny-llama, seed 0: its folder and GGUF."""
    folder, gguf = generate("tiny-llama", tmp_path_factory.mktemp("synth"), seed=0)
    return folder, gguf


def _files(folder: Path, gguf: Path | None) -> dict[str, bytes]:
    out = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
    if gguf is not None:
        out[gguf.name] = gguf.read_bytes()
    return out


def test_the_same_seed_writes_the_same_bytes_another_seed_other_weights(tiny, tmp_path) -> None:
    again = generate("tiny-llama", tmp_path / "again", seed=0)
    assert _files(*tiny) == _files(*again)
    other, _ = generate("tiny-llama", tmp_path / "other", seed=1, gguf=False)
    shards = sorted(p.name for p in other.glob("*.safetensors"))
    assert shards == sorted(p.name for p in tiny[0].glob("*.safetensors")) and len(shards) == 2 + 2  # by layer
    assert all((other / s).read_bytes() != (tiny[0] / s).read_bytes() for s in shards)
    index = json.loads((tiny[0] / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.1.mlp.down_proj.weight"] == "model-00003-of-00004.safetensors"


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-gemma3"])
def test_hetero_reads_the_same_weights_from_the_folder_and_the_gguf(shape, tiny, tmp_path, monkeypatch) -> None:
    """Llama's Q/K rows permuted and its rope_freqs, Gemma's norms stored as 1 + w and its QK-norms (1-D F32, as
    Qwen2's biases): hetero's two readers agree bit for bit, and both carry the marker. (A GGUF load is seconds:
    transformers converts its 49,216-token vocabulary; Qwen2 is left to the configs' test.)"""
    folder, gguf = tiny if shape == "tiny-llama" else generate(shape, tmp_path, seed=0)  # the user cache's default
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    hf, gg = load_model(folder), load_model(gguf)
    assert hf.synthetic == gg.synthetic == f"{shape}, seed 0"
    for name in ("tok_emb", "norm", "lm_head"):
        assert torch.equal(getattr(hf.weights, name), getattr(gg.weights, name)), name
    for a, b in zip(hf.weights.layers, gg.weights.layers, strict=True):
        for f in ("attn_norm", "wq", "wk", "wv", "wo", "w_down", "bq", "bk", "q_norm", "post_ffn_norm"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None and y is None) or torch.equal(x, y), f
    text = "The quick brown fox"
    assert hf.tokenizer(text)["input_ids"] == gg.tokenizer(text)["input_ids"]
    assert gg.config.vocab == hf.config.vocab == SHAPES["llama-3.2-1b"]["vocab_size"] - 128256 + 49216
    assert load_model(gguf).synthetic == hf.synthetic  # a warm load keeps the marker (the cache entry)


def test_transformers_loads_the_folder_and_the_massive_channels_stand_out(tiny) -> None:
    """Finite logits from transformers' own model; after layer 1 the seeded channels are far above the rest."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny[0]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(folder)("The quick brown fox jumps over the lazy dog")["input_ids"]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    assert out.logits.shape[-1] == 49216 and bool(torch.isfinite(out.logits).all())
    mag = out.hidden_states[1][0].abs().mean(0)  # after the first layer: mean |x| per hidden channel
    massive = _massive_channels(0, 128)
    assert 2 <= len(massive) <= 4
    assert set(mag.topk(len(massive)).indices.tolist()) == set(massive)
    assert float(mag[list(massive)].min()) > 10 * float(mag.median())


def test_run_and_info_say_the_weights_are_synthetic(tiny, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    assert main(["info", "--model", str(tiny[1]), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["synthetic"] == "tiny-llama, seed 0" and LINE in err
    assert main(["run", "--model", str(tiny[0]), "Say hi.", "--method", "float", "-n", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["synthetic"] == "tiny-llama, seed 0" and LINE in err


def test_every_shape_is_its_real_config() -> None:
    """The configs as the issue states them, read by hetero through transformers' config classes."""
    tok = load_model().tokenizer  # the default model's: the one the shapes extend
    want = {"llama-3.2-1b": (16, 2048, 32, 8, 64, 8192, 128256), "llama-3.2-3b": (28, 3072, 24, 8, 128, 8192, 128256),
            "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336, 128256), "qwen2.5-1.5b": (28, 1536, 12, 2, 128, 8960, 151936),
            "qwen3-1.7b": (28, 2048, 16, 8, 128, 6144, 151936), "gemma-3-1b": (26, 1152, 4, 1, 256, 6912, 262144)}
    for shape, dims in want.items():
        hf = _config(shape, None, 0, tok)
        c = ModelConfig.from_hf(hf)
        assert (c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn, c.vocab) == dims, shape
        assert hf["hetero_synthetic"] == {"seed": 0, "shape": shape, "layers": c.n_layers, "note": "speed and memory "
                                          "only, never accuracy"}
        assert c.tie_embeddings == (shape != "llama-3.1-8b")
    llama = ModelConfig.from_hf(_config("llama-3.2-1b", None, 0, tok))
    assert llama.rope_theta == 500000 and llama.rope_scaling["factor"] == 32 and llama.context_length == 131072
    qwen2 = ModelConfig.from_hf(_config("qwen2.5-1.5b", None, 0, tok))
    assert qwen2.qkv_bias and qwen2.rms_eps == 1e-6 and qwen2.context_length == 32768 and qwen2.rope_theta == 1e6
    qwen3 = ModelConfig.from_hf(_config("qwen3-1.7b", None, 0, tok))
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.context_length == 40960
    gemma = ModelConfig.from_hf(_config("gemma-3-1b", None, 0, tok))
    assert gemma.windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))
    assert (gemma.act, gemma.local_rope_theta, gemma.rope_theta, gemma.attn_scale) == ("gelu_tanh", 1e4, 1e6, 256**-0.5)


def test_a_marker_hetero_cannot_read_is_refused(tiny, tmp_path) -> None:
    """A synthetic model must never pass for a real one: a damaged marker is a ModelFormatError naming it."""
    import shutil

    from hetero.errors import ModelFormatError

    folder = Path(shutil.copytree(tiny[0], tmp_path / "damaged"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hetero_synthetic"] = {"note": "no shape"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="synthetic-weights marker"):
        load_model(folder)
