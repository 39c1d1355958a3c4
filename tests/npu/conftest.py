"""NPU test fixtures: an isolated graph cache, a tiny model and its plans (with and without shadows)."""

from __future__ import annotations

import pytest
import torch

from hetero.weights import SITES
from hetero.outliers.plan import plan_from_scales
from tests.conftest import make_tiny_model

SHADOWS = {(0, "down_in"): (1, 2), (1, "attn_in"): (3,), (1, "o_in"): (0,), (1, "ffn_in"): (5,)}


@pytest.fixture(autouse=True)
def graph_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def tiny_plan(model, shadow=None, scale: float = 0.02, weight_granularity: str = "channel"):
    # 0.02: RMSNorm outputs of the tiny model reach |x| ≈ 3, so some values clip (and shadows have work)
    return plan_from_scales(model, {(l, s): scale for l in range(model.config.n_layers) for s in SITES}, shadow,
                            weight_granularity=weight_granularity)


@pytest.fixture
def tiny():
    return make_tiny_model()


def assert_layers_match(model, plan, atol: float) -> None:
    """NpuBackend (CPU EP, C=16) against QuantizedBackend on two layers of `model`, qkv and o_ffn."""
    from hetero.npu.graph_backend import NpuBackend
    from hetero.outliers.shadow import QuantizedBackend

    ref, be = QuantizedBackend(model.config, model.weights, plan), NpuBackend(model, plan, 16, provider="cpu")
    g = torch.Generator().manual_seed(1)
    h, a = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g) * 0.5
    for layer in range(2):  # the backend takes and returns numpy (`tensors = "numpy"`), the reference torch
        for got, want in zip(be.qkv(layer, h.numpy()), ref.qkv(layer, h)):
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=atol)
        torch.testing.assert_close(torch.from_numpy(be.o_ffn(layer, a.numpy(), h.numpy())), ref.o_ffn(layer, a, h),
                                   rtol=0, atol=atol)
