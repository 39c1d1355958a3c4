"""The decode row kernel (`decode.rowattn`) computes `model.one_row_attention` up to float32 rounding, reads only
cache rows [0, length), writes into the caller's buffer, and refuses views it cannot read in place; a token tree's
rows in one pass equal one-row steps over their paths bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hetero import model as ref
from hetero.decode.rowattn import decode_rows, row_attention, tree_layout
from hetero.decode.tree import TokenTree
from tests.conftest import make_tiny_model


# query heads per KV head (the kernel takes them in groups of three or four): 2 (padded to 4), 3 (the default
# model's), 4, 5 (4 + 1 padded), 6 (3 + 3)
HEADS = [(4, 2), (3, 1), (4, 1), (5, 1), (6, 1)]


def with_heads(cfg, heads: tuple[int, int]):
    return dataclasses.replace(cfg, n_heads=heads[0], n_kv_heads=heads[1])


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("length", [1, 7, 300])
def test_row_attention_matches_the_matmul_reference(length, heads):
    cfg = with_heads(make_tiny_model().config, heads)
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


@pytest.mark.parametrize("length,window", [(1, 4), (7, 4), (300, 16), (10, 10)])
def test_row_attention_of_a_sliding_window_reads_only_the_window(length, window):
    """A windowed layer's row (keys p-W+1..p) computes `one_row_attention` over the last W rows, none before."""
    cfg = make_tiny_model().config
    gen = torch.Generator().manual_seed(length)
    k = torch.randn(cfg.n_kv_heads, 512, cfg.head_dim, generator=gen)
    v = torch.randn(cfg.n_kv_heads, 512, cfg.head_dim, generator=gen)
    lo = max(0, length - window)
    for t in (k, v):
        t[:, :lo] = float("nan")
        t[:, length:] = float("nan")
    q = torch.randn(cfg.n_heads, 1, cfg.head_dim, generator=gen) * 3
    want = ref.one_row_attention(cfg, q, k[:, lo:length], v[:, lo:length])
    torch.testing.assert_close(row_attention(cfg, q, k, v, length, window=window), want, rtol=1e-5, atol=1e-6)


def test_row_attention_refuses_bad_views():
    cfg = make_tiny_model().config
    k = torch.zeros(cfg.n_kv_heads, 8, cfg.head_dim)
    q = torch.zeros(cfg.n_heads, 1, cfg.head_dim)
    with pytest.raises(ValueError, match="length"):
        row_attention(cfg, q, k, k, 9)
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.zeros(cfg.n_kv_heads, 16, cfg.head_dim)[:, ::2]
        row_attention(cfg, q, strided, strided, 4)


@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (5, 1)])
@pytest.mark.parametrize("window", [0, 2, 20])
@pytest.mark.parametrize("slot", [0, 15, 16, 63, 64, 300])
def test_decode_rows_equal_one_row_steps_over_their_paths(slot, window, heads):
    """A token tree's rows in one pass (`decode_rows`): each row's output is bit for bit `row_attention` over the
    prefix and its own path laid out contiguously (what a plain step of its token reads), its K/V land in its
    cache row, and the rows after the tree are not read. A windowed layer (window 2: shorter than a path) on
    its own RoPE base (Gemma 3's local layers) reads nothing before its window. Slots 63 and 64: a tree across, and
    right after, the kernel's first block of 64 positions."""
    cfg = with_heads(make_tiny_model().config, heads)
    if window:
        cfg = dataclasses.replace(cfg, windows=(window,) * cfg.n_layers, local_rope_theta=100.0)
    rope = ref.RopeTable(cfg, 512)
    gen = torch.Generator().manual_seed(slot)
    parents = [-1, 0, 1, 0, 3, 2, 1]  # siblings at depth 1 and 2, a path of depth 3
    tree = TokenTree(list(range(len(parents))), parents)
    k = torch.randn(cfg.n_kv_heads, 512, cfg.head_dim, generator=gen)
    v = torch.randn(cfg.n_kv_heads, 512, cfg.head_dim, generator=gen)
    k[:, slot:], v[:, slot:] = float("nan"), float("nan")  # the tree's rows are written before they are read
    if window:  # the root row (the shortest path) sees rows slot + 1 - window ..
        k[:, : max(0, slot + 1 - window)], v[:, : max(0, slot + 1 - window)] = float("nan"), float("nan")
    qkv = torch.randn(len(parents), cfg.q_dim + 2 * cfg.kv_dim, generator=gen) * 3
    out = torch.zeros(len(parents), cfg.q_dim)
    layout = tree_layout(tree.depth, tree.parents, slot, rope)
    decode_rows(cfg, qkv.numpy(), k.numpy(), v.numpy(), layout, out.numpy())  # numpy views: the tensors see the writes
    assert torch.isfinite(out).all()
    for i in range(len(parents)):
        path = tree.mask()[i].nonzero()[0].tolist()
        kc, vc = k.clone(), v.clone()
        kc[:, slot : slot + len(path)], vc[:, slot : slot + len(path)] = k[:, slot + torch.tensor(path)], v[:, slot + torch.tensor(path)]
        q = qkv[i, : cfg.q_dim].view(1, cfg.n_heads, cfg.head_dim).transpose(0, 1)
        q = rope.apply(q, 0, torch.tensor([slot + tree.depth[i]]), layer=0)
        want = row_attention(cfg, q.contiguous(), kc, vc, slot + len(path), window=window)
        assert torch.equal(out[i].view(cfg.n_heads, 1, cfg.head_dim), want), f"row {i}"
        kv = qkv[i, cfg.q_dim :].view(2, cfg.n_kv_heads, 1, cfg.head_dim)
        assert torch.equal(k[:, slot + i], rope.apply(kv[0], 0, torch.tensor([slot + tree.depth[i]]), layer=0)[:, 0])
        assert torch.equal(v[:, slot + i], kv[1][:, 0])
