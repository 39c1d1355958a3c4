"""Attention of one decode row over the float32 KV cache in one compiled pass per KV group (numba).

A decode step's attention reads every cached K/V byte once per token (47 MB at context 1024 on the default
model) and does almost no arithmetic, so its speed is how fast it streams the cache. Two MKL matmuls on
the cache views (`model.one_row_attention`) stream cold cache lines at ~12 GB/s here; this kernel reads K
once for all query heads of a group (the g dot products of a cached row while it is in L1), takes the
softmax in place and reads V once (Transformer-Lite §2.4: K/V read in place from the preallocated cache).
The exponentials are a vectorized polynomial (relative error < 3e-7). It is the one function a plain step and every row of a token tree call (`decode.bound.BoundStep`,
`model.attention(row_attention=...)`), so a tree row equals the plain step of its token bit for bit and
greedy speculation emits plain greedy's tokens. Its float32 sums are reassociated (SIMD) and differ from
the matmuls' by rounding only. Measured: docs/design.md, "Decode".
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from hetero.config import ModelConfig
from hetero.model import RopeTable


@numba.njit(cache=True, fastmath=True, nogil=True)
def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, length: int, scale: float, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """q [n_kv, g, D] (query heads grouped by KV head), k/v [n_kv, capacity, D], rows [0, length) valid;
    out [n_kv, g, D] = softmax(q·kᵀ·scale)·v per query head."""
    n_kv, g, d = q.shape
    s = np.empty((g, length), np.float32)
    bits = np.empty(length, np.int32)  # 2^z of each exp as float32 bits
    two_z = bits.view(np.float32)
    sc = np.float32(scale)
    for h in range(n_kv):
        for t in range(length):  # K read once: the group's g dot products of row t
            for j in range(g):
                acc = np.float32(0.0)
                for i in range(d):
                    acc += q[h, j, i] * k[h, t, i]
                s[j, t] = acc * sc
        for j in range(g):
            m = s[j, 0]
            for t in range(1, length):
                m = max(m, s[j, t])
            for t in range(length):  # exp(x) for x <= 0 as 2^z·e^r, |r| <= ln2/2 (Cephes expf): SIMD, unlike libm's
                x = max(s[j, t] - m, np.float32(-87.0))
                z = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
                r = x - z * np.float32(0.693359375) - z * np.float32(-2.12194440e-4)
                p = ((((np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)) * r
                       + np.float32(8.3334519073e-3)) * r + np.float32(4.1665795894e-2)) * r
                     + np.float32(1.6666665459e-1)) * r + np.float32(5.0000001201e-1)
                s[j, t] = p * r * r + r + np.float32(1.0)
                bits[t] = (np.int32(z) + np.int32(127)) << 23
            tot = np.float32(0.0)
            for t in range(length):
                e = s[j, t] * two_z[t]
                s[j, t] = e
                tot += e
            inv = np.float32(1.0) / tot
            for t in range(length):
                s[j, t] *= inv
            for i in range(d):
                out[h, j, i] = 0.0
        for t in range(length):  # V read once
            for j in range(g):
                w = s[j, t]
                for i in range(d):
                    out[h, j, i] += w * v[h, t, i]


def row_attention(cfg: ModelConfig, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """One roped query row q [H, 1, D] (or [H, D]) over cache rows [0, length) of one layer's whole-capacity
    views k_cache/v_cache [n_kv, capacity, D] (contiguous float32, as `KVCache.layer`). Returns [H, 1, D],
    written into `out` (contiguous, H·D float32) when given."""
    if not 0 < length <= k_cache.shape[1]:
        raise ValueError(f"length must be in [1, {k_cache.shape[1]}], got {length}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == torch.float32):
        raise ValueError("k_cache and v_cache must be contiguous float32 [n_kv, capacity, D] views")
    g = cfg.n_heads // cfg.n_kv_heads
    qg = q.reshape(cfg.n_kv_heads, g, cfg.head_dim).contiguous()
    if out is None:
        out = torch.empty(cfg.n_heads, 1, cfg.head_dim)
    _attend(qg.numpy(), k_cache.numpy(), v_cache.numpy(), length, cfg.head_dim**-0.5,
            out.view(cfg.n_kv_heads, g, cfg.head_dim).numpy())
    return out.view(cfg.n_heads, 1, cfg.head_dim)


@numba.njit(cache=True, nogil=True)
def _rope_row(qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_heads: int, n_kv: int, d: int,
              k: np.ndarray, v: np.ndarray, slot: int, q: np.ndarray) -> None:  # pragma: no cover - compiled
    """RoPE of one row's q and k heads (qkv [q_dim + 2·kv_dim]) at one position (cos/sin [D/2]) into q [H, D] and
    k[:, slot]; its v into v[:, slot]. No fastmath: each product and sum rounds as `model.RopeTable.apply`'s
    elementwise torch ops, so the values equal a tree row's."""
    half = d // 2
    for hh in range(n_heads + n_kv):
        base = hh * d
        for i in range(half):
            x1, x2 = qkv[base + i], qkv[base + half + i]
            a = x1 * cos[i] - x2 * sin[i]
            b = x2 * cos[i] + x1 * sin[i]
            if hh < n_heads:
                q[hh, i], q[hh, half + i] = a, b
            else:
                k[hh - n_heads, slot, i], k[hh - n_heads, slot, half + i] = a, b
    vbase = (n_heads + n_kv) * d
    for h in range(n_kv):
        for i in range(d):
            v[h, slot, i] = qkv[vbase + h * d + i]


def decode_row(cfg: ModelConfig, qkv: torch.Tensor, rope: RopeTable, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot: int, out: torch.Tensor) -> None:
    """A plain decode step's attention for its one row in two compiled calls: RoPE of qkv [1, q_dim + 2·kv_dim] at
    position `slot`, its K/V into cache row `slot`, `row_attention` over rows [0, slot] into `out` ([1, q_dim],
    contiguous). Equals `model.attention(..., row_attention=row_attention)` for that row bit for bit (tested)."""
    if not 0 <= slot < k_cache.shape[1]:
        raise ValueError(f"slot must be in [0, {k_cache.shape[1]}), got {slot}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and qkv.is_contiguous() and out.is_contiguous()):
        raise ValueError("qkv, k_cache, v_cache and out must be contiguous")
    g, d = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    q = np.empty((cfg.n_heads, d), np.float32)
    kn, vn = k_cache.numpy(), v_cache.numpy()
    _rope_row(qkv.numpy().reshape(-1), rope.cos[slot].numpy(), rope.sin[slot].numpy(), cfg.n_heads, cfg.n_kv_heads, d,
              kn, vn, slot, q)
    _attend(q.reshape(cfg.n_kv_heads, g, d), kn, vn, slot + 1, d**-0.5, out.numpy().reshape(cfg.n_kv_heads, g, d))
