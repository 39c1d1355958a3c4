"""Shared fixtures: a tiny random Llama (fast unit tests) and the real default model (integration)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero.threads import passive_openmp

passive_openmp()  # the tests are an edge too: OpenMP's wait policy before torch loads (hetero/threads.py)
import torch  # noqa: E402

from hetero.config import ModelConfig
from hetero.loader import Model, load_model
from hetero.weights import LayerWeights, Weights


def make_tiny_model(arch: str = "llama", seed: int = 0, n_layers: int = 2, qkv_bias: bool | None = None) -> Model:
    """A random Llama-family model small enough for unit tests (hidden 64, 4 heads, 2 KV heads)."""
    g = torch.Generator().manual_seed(seed)
    bias = arch == "qwen2" if qkv_bias is None else qkv_bias
    cfg = ModelConfig(arch=arch, n_layers=n_layers, hidden=64, n_heads=4, n_kv_heads=2, ffn=128, vocab=256,
                      context_length=512, rms_eps=1e-5, rope_theta=10000.0, qkv_bias=bias, tie_embeddings=True)

    def r(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    layers = [
        LayerWeights(
            attn_norm=1 + r(64, scale=0.1), wq=r(64, 64), wk=r(32, 64), wv=r(32, 64), wo=r(64, 64),
            ffn_norm=1 + r(64, scale=0.1), w_gate=r(128, 64), w_up=r(128, 64), w_down=r(64, 128),
            bq=r(64) if bias else None, bk=r(32) if bias else None, bv=r(32) if bias else None,
        )
        for _ in range(n_layers)
    ]
    emb = r(256, 64, scale=0.5)
    return Model(cfg, Weights(emb, layers, 1 + r(64, scale=0.1), emb), None, Path("tiny"), f"tiny-{arch}-{seed}", "tiny")


@pytest.fixture
def tiny_model() -> Model:
    return make_tiny_model()


@pytest.fixture(scope="session")
def default_model() -> Model:
    """SmolLM2-135M-Instruct from its GGUF (fetched once into the user cache)."""
    return load_model()


@pytest.fixture(scope="session")
def real_text_ids(default_model: Model) -> torch.Tensor:
    """~2,800 tokens of real text: the opening of Pride and Prejudice (public domain)."""
    text = (Path(__file__).parent / "data" / "sample.txt").read_text()
    return torch.tensor(default_model.tokenizer(text)["input_ids"])
