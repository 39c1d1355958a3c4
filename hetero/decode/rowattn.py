"""Attention of decode rows over the float32 KV cache in one compiled pass per KV group (numba).

A decode step's attention reads every cached K/V byte once per token (47 MB at context 1024 on the default
model) and does almost no arithmetic, so its speed is how fast it streams the cache. Two MKL matmuls on
the cache views (`model.one_row_attention`) stream cold cache lines at ~12 GB/s here; this kernel reads K
once for all query heads of a group (the g dot products of a cached row while it is in L1), takes the
softmax in place and reads V once (Transformer-Lite §2.4: K/V read in place from the preallocated cache).
The exponentials are a vectorized polynomial (relative error < 3e-7).

A token tree verified as one chunk (LLMCad §3.2) shares the cache prefix among its rows: `decode_rows` reads
each cached row once for all of them (a row per tree row would read the cache once per row: a 4-row tree
cost 2.3× a plain step). Each row still sees only the prefix and its own path, and every sum of a row is
the same compiled statement whatever rows come with it, so a tree row equals the plain step of its token
bit for bit (`row_attention`, the one-row form `model.attention(row_attention=...)` calls) and greedy
speculation emits plain greedy's tokens. Its float32 sums are reassociated (SIMD) and differ from the
matmuls' by rounding only. Measured: docs/journal.md, "Decoding".
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numba
import numpy as np
from numba.core import types
from numba.cpython.unsafe.tuple import tuple_setitem

from hetero import jitcache
from hetero.decode.twocore import native
from hetero.config import ModelConfig
from hetero.rope import RopeTable

if TYPE_CHECKING:
    import torch


@jitcache.njit(fastmath=True, inline="always")
def _dots(q: np.ndarray, jg: int, kv: np.ndarray, group: tuple) -> tuple:  # pragma: no cover
    """q[jg + j]·kv for each query head j of a group, the K row loaded once for all of them. The group's size is
    len(group) (float32s), a constant of its type, so the loop over the heads unrolls and the sums stay in registers."""
    acc = group
    for j in range(len(acc)):  # zeros the compiler sees (the caller's are values it passes)
        acc = tuple_setitem(acc, j, np.float32(0.0))
    for i in range(kv.shape[0]):
        x = kv[i]
        for j in range(len(acc)):
            acc = tuple_setitem(acc, j, acc[j] + q[jg + j, i] * x)
    return acc


@jitcache.njit(fastmath=True, inline="always")
def _axpys(o: np.ndarray, jg: int, w: tuple, vv: np.ndarray) -> None:  # pragma: no cover
    """o[jg + j] += w[j]·vv for each query head j of a group (`_dots`' form): the V row is loaded once for all."""
    for i in range(vv.shape[0]):
        x = vv[i]
        for j in range(len(w)):
            o[jg + j, i] += w[j] * x


@jitcache.njit(fastmath=True, nogil=True)
def _attend_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, prefix: int, extra: np.ndarray, n_extra: np.ndarray,
                 scale: float, out: np.ndarray, h0: int, h1: int, window: int, off: int,
                 group: tuple) -> None:  # pragma: no cover - compiled
    """q [R, n_kv, g, D] (query heads grouped by KV head), k/v [n_kv, capacity, D]. Row r sees cache rows
    [0, prefix) and then extra[r, :n_extra[r]] - off (rows of a layer whose row 0 holds position `off`, a windowed
    layer keeping its window), in that order, of which only the last `window` when window > 0
    (a sliding-window layer: keys p-W+1..p, as transformers' mask); out[:, h0:h1] = softmax(q·kᵀ·scale)·v of KV
    heads [h0, h1) (out [R, n_kv, g, D]). The heads are independent: two threads may share them (`AttentionPool`).
    A windowed layer reads only the rows some row's window covers.

    The query heads of a KV head go in groups of len(group) (float32 zeros: three where g is a multiple of 3, else
    four, zero rows padding the last): a group's dot products with a K row (`_dots`) and its updates with a V row
    (`_axpys`) load the row once for all of them, and the rows go in blocks of 64 positions (`sweep`) that stay in L1
    while each tree row takes its share. Every score, softmax and output sum of a row is computed by the same
    statement whichever rows come with it and whether a cache row is in the prefix or an extra: a row's result depends
    only on its query and the sequence of cache rows it sees, so a tree row equals the plain step of its token bit for
    bit."""
    rows, n_kv, g, d = q.shape
    span = prefix + extra.shape[1]
    lo = np.zeros(rows, np.int64)
    hi = np.zeros(rows, np.int64)
    first = span
    for r in range(rows):
        hi[r] = prefix + n_extra[r]
        if window > 0:
            lo[r] = max(0, hi[r] - window)
        first = min(first, lo[r])
    G = len(group)
    gp = (g + G - 1) // G * G
    B = 64
    s = np.empty((rows, gp, span), np.float32)
    bits = np.empty(span, np.int32)
    two_z = bits.view(np.float32)
    qp = np.zeros((rows, gp, d), np.float32)
    o = np.empty((rows, gp, d), np.float32)
    sc = np.float32(scale)

    def sweep(h: int, values: bool) -> None:
        """Every row's cache rows of KV head h, block by block: its scores s = q·k·scale, or (values) o += s·v."""
        for tb in range(first, span, B):
            te = min(tb + B, span)
            for r in range(rows):
                for jg in range(0, gp, G):
                    for t in range(max(tb, lo[r]), min(te, hi[r])):
                        row, tt = t if t < prefix else extra[r, t - prefix] - off, t - lo[r]
                        if values:
                            w = group
                            for j in range(G):
                                w = tuple_setitem(w, j, s[r, jg + j, tt])
                            _axpys(o[r], jg, w, v[h, row])
                        else:
                            a = _dots(qp[r], jg, k[h, row], group)
                            for j in range(G):
                                s[r, jg + j, tt] = a[j] * sc

    for h in range(h0, h1):
        for r in range(rows):
            for j in range(g):
                for i in range(d):
                    qp[r, j, i] = q[r, h, j, i]
        sweep(h, False)
        for r in range(rows):
            length = hi[r] - lo[r]
            for j in range(g):
                m = s[r, j, 0]
                for t in range(1, length):
                    m = max(m, s[r, j, t])
                for t in range(length):
                    x = max(s[r, j, t] - m, np.float32(-87.0))
                    z = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
                    e = x - z * np.float32(0.693359375) - z * np.float32(-2.12194440e-4)
                    p = ((((np.float32(1.9875691500e-4) * e + np.float32(1.3981999507e-3)) * e
                           + np.float32(8.3334519073e-3)) * e + np.float32(4.1665795894e-2)) * e
                         + np.float32(1.6666665459e-1)) * e + np.float32(5.0000001201e-1)
                    s[r, j, t] = p * e * e + e + np.float32(1.0)
                    bits[t] = (np.int32(z) + np.int32(127)) << 23
                tot = np.float32(0.0)
                for t in range(length):
                    w = s[r, j, t] * two_z[t]
                    s[r, j, t] = w
                    tot += w
                inv = np.float32(1.0) / tot
                for t in range(length):
                    s[r, j, t] *= inv
            for j in range(gp):
                for i in range(d):
                    o[r, j, i] = 0.0
            for j in range(g, gp):  # padding heads: zero weights
                for t in range(length):
                    s[r, j, t] = 0.0
        sweep(h, True)
        for r in range(rows):
            for j in range(g):
                for i in range(d):
                    out[r, h, j, i] = o[r, j, i]


# `attend`'s argument record (int64): where `_attend_record` finds `_attend_rows`' arrays and numbers
(_Q, _ROWS, _NKV, _G, _D, _K, _V, _CAP, _PREFIX, _EXTRA, _WIDTH, _NEXTRA, _SCALE, _OUT, _H0, _H1, _WINDOW,
 _OFF) = range(18)
_RECORD = 18


def _attend_record(record: int, unused_a: int, unused_b: int) -> int:  # pragma: no cover - compiled
    """`_attend_rows` on the arrays an argument record names (`attend`): the one compiled copy of the kernel that
    every caller runs. Each njit caller inlines the kernel and LLVM optimizes every copy on its own under fastmath,
    so two callers' copies rounded differently: a step with the helper thread (`twocore.attnpool`) gave other logits
    than one without it, and greedy output changed with the machine's load."""
    r = numba.carray(native.pointer(record, np.int64), _RECORD)
    rows, n_kv, g, d, cap = r[_ROWS], r[_NKV], r[_G], r[_D], r[_CAP]
    f32 = np.float32
    q = numba.carray(native.pointer(r[_Q], f32), (rows, n_kv, g, d))
    k = numba.carray(native.pointer(r[_K], f32), (n_kv, cap, d))
    v = numba.carray(native.pointer(r[_V], f32), (n_kv, cap, d))
    extra = numba.carray(native.pointer(r[_EXTRA], np.int64), (rows, r[_WIDTH]))
    n_extra = numba.carray(native.pointer(r[_NEXTRA], np.int64), rows)
    out = numba.carray(native.pointer(r[_OUT], f32), (rows, n_kv, g, d))
    scale, z = native.float_of_bits(r[_SCALE]), f32(0.0)
    if g % 3 == 0:  # the kernel is compiled once per group size (a tuple's length is part of its type: `_dots`)
        _attend_rows(q, k, v, r[_PREFIX], extra, n_extra, scale, out, r[_H0], r[_H1], r[_WINDOW], r[_OFF], (z, z, z))
    else:
        _attend_rows(q, k, v, r[_PREFIX], extra, n_extra, scale, out, r[_H0], r[_H1], r[_WINDOW], r[_OFF],
                     (z, z, z, z))
    return 0


@functools.cache
def attend_entry() -> Any:
    """`_attend_record` as one C function (a numba cfunc, from numba's cache), made at the first decode step: loading
    it starts LLVM's JIT (~46 MB), which a process should not hold through its prefill, whose peak it would raise.
    Compiled by a child process into the cache (`jitcache.compile_apart`): every process runs the cached code."""
    jitcache.compile_apart(__name__, "attend_entry")
    signature = types.int64(types.int64, types.int64, types.int64)
    return jitcache.cfunc(signature, fastmath=True, nogil=True)(_attend_record)


def entry() -> int:
    """The address of `attend_entry`: passed to compiled callers as an argument (a frozen address would be cached)."""
    return attend_entry().address


@jitcache.njit(nogil=True)
def attend(entry: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, prefix: int, extra: np.ndarray,
           n_extra: np.ndarray, scale: float, out: np.ndarray, h0: int, h1: int, window: int,
           off: int) -> None:  # pragma: no cover - compiled
    """`_attend_rows` (same arguments; all C-contiguous, k/v one layer's [n_kv, capacity, D]) through the C entry
    at `entry` (`entry()`): the one compiled kernel whether the caller is Python or a compiled loop, so a row's
    result does not depend on which thread or path computed it."""
    rec = np.empty(_RECORD, np.int64)
    rec[_Q], rec[_ROWS], rec[_NKV], rec[_G], rec[_D] = q.ctypes.data, q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    rec[_K], rec[_V], rec[_CAP], rec[_PREFIX] = k.ctypes.data, v.ctypes.data, k.shape[1], prefix
    rec[_EXTRA], rec[_WIDTH], rec[_NEXTRA] = extra.ctypes.data, extra.shape[1], n_extra.ctypes.data
    rec[_SCALE] = np.array([scale], np.float64).view(np.int64)[0]
    rec[_OUT], rec[_H0], rec[_H1], rec[_WINDOW], rec[_OFF] = out.ctypes.data, h0, h1, window, off
    native.call3(entry, rec.ctypes.data, 0, 0)
    rec[0] = 0  # rec is used after the call, so it is freed only after it


_NO_EXTRA = np.zeros((1, 0), np.int64)
_ZERO = np.zeros(1, np.int64)


def row_attention(cfg: ModelConfig, q: "torch.Tensor", k_cache: "torch.Tensor", v_cache: "torch.Tensor", length: int,
                  out: "torch.Tensor | None" = None, window: int = 0) -> "torch.Tensor":
    """One roped query row q [H, 1, D] (or [H, D]) over cache rows [0, length) of one layer's whole-capacity
    views k_cache/v_cache [n_kv, capacity, D] (contiguous float32, as `KVCache.layer` seen by torch), the last
    `window` of them when window > 0. Returns [H, 1, D], written into `out` (contiguous, H·D float32) when given.
    The row kernel of the float reference (`model.attention(row_attention=...)`), so torch tensors in and out."""
    import torch

    if not 0 < length <= k_cache.shape[1]:
        raise ValueError(f"length must be in [1, {k_cache.shape[1]}], got {length}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == torch.float32):
        raise ValueError("k_cache and v_cache must be contiguous float32 [n_kv, capacity, D] views")
    g = cfg.n_heads // cfg.n_kv_heads
    qg = q.reshape(cfg.n_kv_heads, g, cfg.head_dim).contiguous()
    if out is None:
        out = torch.empty(cfg.n_heads, 1, cfg.head_dim)
    attend(entry(), qg.numpy()[None], k_cache.numpy(), v_cache.numpy(), length, _NO_EXTRA, _ZERO, cfg.scale,
                 out.view(1, cfg.n_kv_heads, g, cfg.head_dim).numpy(), 0, cfg.n_kv_heads, window, 0)
    return out.view(cfg.n_heads, 1, cfg.head_dim)


def _contiguous(*arrays: np.ndarray) -> bool:
    return all(a.flags.c_contiguous for a in arrays)


@jitcache.njit(nogil=True)
def _rope_rows(qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_heads: int, n_kv: int, d: int,
               k: np.ndarray, v: np.ndarray, slot: int, q: np.ndarray) -> None:  # pragma: no cover - compiled
    """RoPE of each row's q and k heads (qkv [R, q_dim + 2·kv_dim]) at its position (cos/sin [R, R_dim/2]) into
    q [R, H, D] and k[:, slot + r]; its v into v[:, slot + r]. The first R_dim dims of a head rotate, the rest pass
    (Phi's partial rotary). No fastmath: each product and sum rounds as `rope.RopeTable.apply`'s torch ops."""
    half = cos.shape[1]
    vbase = (n_heads + n_kv) * d
    for r in range(qkv.shape[0]):
        row = slot + r
        for hh in range(n_heads + n_kv):
            base = hh * d
            for i in range(half):
                x1, x2 = qkv[r, base + i], qkv[r, base + half + i]
                a = x1 * cos[r, i] - x2 * sin[r, i]
                b = x2 * cos[r, i] + x1 * sin[r, i]
                if hh < n_heads:
                    q[r, hh, i], q[r, hh, half + i] = a, b
                else:
                    k[hh - n_heads, row, i], k[hh - n_heads, row, half + i] = a, b
            for i in range(2 * half, d):
                if hh < n_heads:
                    q[r, hh, i] = qkv[r, base + i]
                else:
                    k[hh - n_heads, row, i] = qkv[r, base + i]
        for h in range(n_kv):
            for i in range(d):
                v[h, row, i] = qkv[r, vbase + h * d + i]


@dataclass(frozen=True, slots=True)
class RowLayout:
    """Where a decode chunk's n rows sit in the cache and what each sees; built once a step for every layer."""

    slot: int  # the rows are cache rows slot..slot+n-1, in tree order
    extra: np.ndarray  # [n, max depth + 1] int64: each row's path (root .. itself) as cache rows
    n_extra: np.ndarray  # [n] int64: its length
    cos: np.ndarray  # [n, D/2] float32: RoPE at each row's position (slot + depth)
    sin: np.ndarray
    local_cos: np.ndarray | None = None  # the same of the windowed layers' own base (Gemma 3), None: none
    local_sin: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.n_extra)

    def rope(self, cfg: ModelConfig, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) [n, D/2] of `layer` (`rope.RopeTable.tables`)."""
        return (self.local_cos, self.local_sin) if cfg.local_rope(layer) else (self.cos, self.sin)


@jitcache.njit(nogil=True)
def _paths(parents: np.ndarray, slot: int, width: int) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover
    """Each node's path (root .. itself) as cache rows slot + index, and its length."""
    n = parents.shape[0]
    extra = np.zeros((n, width), np.int64)
    n_extra = np.zeros(n, np.int64)
    for i in range(n):
        length, node = 0, i
        while node >= 0:
            length += 1
            node = parents[node]
        node = i
        for j in range(length - 1, -1, -1):
            extra[i, j] = slot + node
            node = parents[node]
        n_extra[i] = length
    return extra, n_extra


def tree_layout(depth: list[int], parents: list[int], slot: int, rope: RopeTable) -> RowLayout:
    """The `RowLayout` of a token tree (node i's parent parents[i], its depth depth[i]) rooted at cache row `slot`.
    Built once a step: a chain's RoPE rows are a slice of the table, a tree's are gathered."""
    n, deepest = len(parents), max(depth)
    if slot < 0 or slot + deepest >= rope.cos.shape[0]:
        raise ValueError(f"positions {slot}..{slot + deepest} must lie in [0, {rope.cos.shape[0]})")
    extra, n_extra = _paths(np.asarray(parents, np.int64), slot, deepest + 1)
    tables = [rope.cos, rope.sin] + ([] if rope.local_cos is None else [rope.local_cos, rope.local_sin])
    if list(depth) == list(range(n)):  # a chain: positions slot .. slot + n - 1
        rows = [t[slot : slot + n] for t in tables]
    else:
        positions = np.asarray(depth, np.int64) + slot
        rows = [t[positions] for t in tables]
    return RowLayout(slot, extra, n_extra, *rows)


def rope_rows(cfg: ModelConfig, qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, layout: RowLayout,
              q: np.ndarray, layer: int = 0, base: int = 0) -> None:
    """RoPE of the rows' q and k (qkv [>= n, q_dim + 2·kv_dim]) at their positions (layer `layer`'s table): q into
    q [n, n_kv, g, D] (C-contiguous float32), k and v into cache rows slot-base..slot-base+n-1 of one layer's views
    [n_kv, capacity, D] whose row 0 holds position `base` (`KVCache.place`)."""
    n, slot = len(layout), layout.slot - base
    if slot + n > k_cache.shape[1]:
        raise ValueError(f"rows {slot}..{slot + n - 1} must lie in the cache (capacity {k_cache.shape[1]})")
    if not _contiguous(k_cache, v_cache, qkv):
        raise ValueError("qkv, k_cache and v_cache must be contiguous")
    d = cfg.head_dim
    cos, sin = layout.rope(cfg, layer)
    _rope_rows(qkv[:n], cos, sin, cfg.n_heads, cfg.n_kv_heads, d, k_cache, v_cache, slot, q.reshape(n, cfg.n_heads, d))


def decode_rows(cfg: ModelConfig, qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, layout: RowLayout,
                out: np.ndarray, layer: int = 0, base: int = 0) -> None:
    """A decode step's attention for its n rows (one token, or a token tree as one chunk, LLMCad §3.2) in two
    compiled calls: RoPE of qkv [>= n, q_dim + 2·kv_dim] at the rows' positions, their K/V into cache rows
    slot..slot+n-1 (`rope_rows`), and each row's attention over [0, slot) and its path (`tree_layout`) into
    out [>= n, q_dim] (contiguous): the cache is read once for all rows. A row's result is bit for bit that of
    `row_attention` over the same keys in a contiguous cache (tested), so greedy speculation emits plain
    greedy's tokens. `attnpool.AttentionPool` runs the same kernel per KV head on two threads. `layer` picks
    the layer's RoPE table and sliding window (`ModelConfig.local_rope`, `window`); `base`: the position the layer's
    row 0 holds (a windowed layer keeping its window, `KVCache.place`)."""
    if not _contiguous(out):
        raise ValueError("out must be contiguous")
    n, g, d = len(layout), cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    q = np.empty((n, cfg.n_kv_heads, g, d), np.float32)
    rope_rows(cfg, qkv, k_cache, v_cache, layout, q, layer, base)
    attend(entry(), q, k_cache, v_cache, layout.slot - base, layout.extra, layout.n_extra, cfg.scale,
                 out[:n].reshape(n, cfg.n_kv_heads, g, d), 0, cfg.n_kv_heads, cfg.window(layer), base)
