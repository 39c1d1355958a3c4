"""Fixtures: a tiny random Llama (2 layers, hidden 64) with planted activation outliers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetero.config import ModelConfig
from hetero.loader import Model
from hetero.weights import LayerWeights, Weights


def outlier_model(seed: int = 0, fingerprint: str = "tiny0000deadbeef") -> Model:
    cfg = ModelConfig(arch="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=128, vocab=256,
                      context_length=512, rms_eps=1e-5, rope_theta=10000.0)
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    layers = []
    for _ in range(cfg.n_layers):
        attn_norm = torch.ones(cfg.hidden)
        attn_norm[[3, 17]] = 12.0  # planted outlier channels of attn_in / ffn_in (as real LLMs have)
        ffn_norm = torch.ones(cfg.hidden)
        ffn_norm[[5]] = 15.0
        layers.append(LayerWeights(attn_norm, r(cfg.q_dim, cfg.hidden), r(cfg.kv_dim, cfg.hidden),
                                   r(cfg.kv_dim, cfg.hidden), r(cfg.hidden, cfg.q_dim), ffn_norm,
                                   r(cfg.ffn, cfg.hidden), r(cfg.ffn, cfg.hidden), r(cfg.hidden, cfg.ffn)))
    emb = r(cfg.vocab, cfg.hidden, scale=1.0)
    w = Weights(emb, layers, torch.ones(cfg.hidden), emb)
    return Model(cfg, w, None, Path("/nonexistent/tiny.gguf"), fingerprint, "tiny")


@pytest.fixture(scope="session")
def tiny() -> Model:
    return outlier_model()


@pytest.fixture
def make_tiny():
    """The tiny model factory, e.g. for a second model with another fingerprint."""
    return outlier_model


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(1))
