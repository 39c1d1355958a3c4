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


def make_tiny_model(arch: str = "llama", seed: int = 0, n_layers: int = 2, qkv_bias: bool | None = None,
                    head_dim: int = 16) -> Model:
    """A random Llama-family model small enough for unit tests (4 heads of `head_dim`, 2 KV heads: hidden 64 by
    default; head_dim 32 is the smallest the BF16 attention kernel takes, `native.attention`)."""
    g = torch.Generator().manual_seed(seed)
    bias = arch == "qwen2" if qkv_bias is None else qkv_bias
    hd, kd, ffn = 4 * head_dim, 2 * head_dim, 8 * head_dim
    cfg = ModelConfig(arch=arch, n_layers=n_layers, hidden=hd, n_heads=4, n_kv_heads=2, ffn=ffn, vocab=256,
                      context_length=512, rms_eps=1e-5, rope_theta=10000.0, qkv_bias=bias, tie_embeddings=True)

    def r(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    layers = [
        LayerWeights(
            attn_norm=1 + r(hd, scale=0.1), wq=r(hd, hd), wk=r(kd, hd), wv=r(kd, hd), wo=r(hd, hd),
            ffn_norm=1 + r(hd, scale=0.1), w_gate=r(ffn, hd), w_up=r(ffn, hd), w_down=r(hd, ffn),
            bq=r(hd) if bias else None, bk=r(kd) if bias else None, bv=r(kd) if bias else None,
        )
        for _ in range(n_layers)
    ]
    emb = r(256, hd, scale=0.5)
    name = f"tiny-{arch}-{seed}" + ("" if head_dim == 16 else f"-d{head_dim}")
    return Model(cfg, Weights(emb, layers, 1 + r(hd, scale=0.1), emb), None, Path("tiny"), name, "tiny")


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
