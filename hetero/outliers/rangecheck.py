"""Range checks of a site's input against the INT8 range (mllm-NPU §3.3, Eq. 1), each one compiled pass.

At decode most site inputs have no outlier (83% of them on the default model), so the shadow work of a site
is mostly the check that says so. Done with torch (the online Hadamard as a matmul, `aminmax`, two `.item()`)
it is half a dozen small ops, each a dispatch whose code the step's ~106 MB of streamed weights has evicted
from the caches (~40 µs a site inside a step vs ~10 µs alone); here it is one compiled call. The check is
conservative: a row counts as inside only when its transformed values are inside by a margin that covers the
rounding of any summation order, so a row it passes is one the exact torch path would not correct either
(`QuantizedBackend.rows_maybe_beyond`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import functools

import numpy as np

from hetero import jitcache
from hetero.outliers.rotate import hadamard

if TYPE_CHECKING:
    import torch

# reassociation and FMA contraction only: a NaN must stay a NaN (it compares as "not inside")
_FAST = {"reassoc", "contract", "nsz", "arcp"}


@jitcache.njit(nogil=True, fastmath=_FAST)
def _rows_inside(x: np.ndarray, h: np.ndarray, lo: float, hi: float, rel: float,
                 out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[r] = every value of row r of x·T lies in [lo + m, hi - m], m = rel·‖x_r‖₁ (T = diag(H, …, H) with
    h = H [b, b]; b = 0: no transform and m = 0)."""
    rows, n = x.shape
    b = h.shape[0]
    for r in range(rows):
        ok = True
        if b == 0:
            for i in range(n):
                v = x[r, i]
                if not (lo <= v and v <= hi):
                    ok = False
                    break
        else:
            l1 = np.float32(0.0)
            for i in range(n):
                l1 += abs(x[r, i])
            m = rel * l1
            lo_m, hi_m = lo + m, hi - m
            y = np.empty(b, np.float32)
            for base in range(0, n, b):
                y[:] = 0.0
                for i in range(b):  # y = x_blk·H, a row of H at a time (SIMD over the block)
                    xi = x[r, base + i]
                    for j in range(b):
                        y[j] += xi * h[i, j]
                low, high = y[0], y[0]
                for j in range(1, b):
                    low = min(low, y[j])
                    high = max(high, y[j])
                if not (lo_m <= low and high <= hi_m):
                    ok = False
                    break
        out[r] = ok


_NO_TRANSFORM = np.zeros((0, 0), np.float32)


@functools.lru_cache(maxsize=None)
def _hadamard32(block: int) -> np.ndarray:
    import torch

    return np.ascontiguousarray(hadamard(block).to(torch.float32).numpy())


def rows_inside(x: torch.Tensor, lo: float, hi: float, block: int | None) -> np.ndarray:
    """bool [T]: row r of x [T, n] (float32), transformed alone by the online Hadamard of `block` (None: none),
    surely lies in [lo, hi]. A float32 dot product of b terms with entries ±1/√b rounds by at most √b·u·‖x_r‖₁
    in any order (u: unit roundoff), so two ways of computing it differ by at most √b·eps·‖x_r‖₁ (eps = 2u):
    a row counts as inside only when it is inside by 4× that."""
    xs = x.detach().contiguous().numpy()
    out = np.empty(xs.shape[0], np.bool_)
    if block is None:
        _rows_inside(xs, _NO_TRANSFORM, float(lo), float(hi), 0.0, out)
    else:
        rel = 4 * block**0.5 * float(np.finfo(np.float32).eps)
        _rows_inside(xs, _hadamard32(block), float(lo), float(hi), rel, out)
    return out


@jitcache.njit(nogil=True)
def _split(x: np.ndarray, lo: np.float32, hi: np.float32) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover
    """(channels, r): the columns of x [T, n] with some value beyond [lo, hi], and r = x − clip(x, lo, hi) on them."""
    rows, n = x.shape
    beyond = np.zeros(n, np.bool_)
    for t in range(rows):
        for c in range(n):
            v = x[t, c]
            if v < lo or v > hi:
                beyond[c] = True
    channels = np.flatnonzero(beyond)
    r = np.empty((rows, channels.shape[0]), np.float32)
    for t in range(rows):
        for j in range(channels.shape[0]):
            v = x[t, channels[j]]
            r[t, j] = v - min(max(v, lo), hi)
    return channels, r


def split_beyond(x: torch.Tensor, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(channels int64 [k], r float32 [T, k]): the columns of x [T, n] (float32) where some value lies beyond
    [lo, hi] (compared in float32, as torch compares a float32 tensor with a Python float) and x − clip(x, lo, hi)
    on them, in one compiled pass (torch took ~8 small ops)."""
    import torch

    channels, r = _split(x.detach().contiguous().numpy(), np.float32(lo), np.float32(hi))
    return torch.from_numpy(channels), torch.from_numpy(r)
