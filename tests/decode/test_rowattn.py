"""The decode row kernel (`decode.rowattn`) computes `model.one_row_attention` up to float32 rounding, reads only
cache rows [0, length), writes into the caller's buffer, and refuses views it cannot read in place."""

from __future__ import annotations

import pytest
import torch

from hetero import model as ref
from hetero.decode.rowattn import row_attention
from tests.conftest import make_tiny_model


@pytest.mark.parametrize("length", [1, 7, 300])
def test_row_attention_matches_the_matmul_reference(length):
    cfg = make_tiny_model().config
    gen = torch.Generator().manual_seed(length)
    k = torch.randn(cfg.n_kv_heads, 512, cfg.head_dim, generator=gen)
    v = torch.randn(cfg.n_kv_heads, 512, cfg.head_dim, generator=gen)
    k[:, length:] = float("nan")  # rows past `length` must not be read
    v[:, length:] = float("nan")
    q = torch.randn(cfg.n_heads, 1, cfg.head_dim, generator=gen) * 3
    want = ref.one_row_attention(cfg, q, k[:, :length], v[:, :length])
    out = torch.empty(1, cfg.q_dim)
    got = row_attention(cfg, q, k, v, length, out=out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.view(cfg.n_heads, 1, cfg.head_dim), got)
    assert torch.equal(row_attention(cfg, q, k, v, length), got)  # deterministic: the tree rows rely on it


def test_row_attention_refuses_bad_views():
    cfg = make_tiny_model().config
    k = torch.zeros(cfg.n_kv_heads, 8, cfg.head_dim)
    q = torch.zeros(cfg.n_heads, 1, cfg.head_dim)
    with pytest.raises(ValueError, match="length"):
        row_attention(cfg, q, k, k, 9)
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.zeros(cfg.n_kv_heads, 16, cfg.head_dim)[:, ::2]
        row_attention(cfg, q, strided, strided, 4)
