"""Per-chunk KV compression: channel-wise INT8 / INT4 chosen by measured attention-output error.

LLMS §3.2 (tolerance-aware compression): chunks differ in how much precision they need, so each chunk
gets the fewest bits whose error stays within a tolerance. The quantiser is LLMS's channel-wise linear
one: a min and a scale per (layer, head, dim) channel over the chunk's tokens; INT4 packs two values a
byte. The error is measured, not assumed: attention with the chunk's own keys as probe queries, float
vs dequantised K/V, relative L2 of the output (a proxy for the real queries, which are not kept).
Numpy throughout (K/V blocks are numpy at rest): the store never needs torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LEVELS = ("int4", "int8")  # tried in this order: the fewest bits within the tolerance wins
_QMAX = {"int8": 255, "int4": 15}


@dataclass(frozen=True, slots=True)
class QTensor:
    """A channel-wise quantised [L, H, n, D] array: codes (uint8; INT4 packs pairs along D)."""

    level: str
    codes: np.ndarray  # uint8; int8: [L, H, n, D]; int4: [L, H, n, D/2]
    lo: np.ndarray  # [L, H, 1, D] per-channel minimum (float16: halves the per-channel overhead)
    scale: np.ndarray  # [L, H, 1, D] (float16)
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.lo.nbytes + self.scale.nbytes


def quantize(x: np.ndarray, level: str) -> QTensor:
    """x: [L, H, n, D] float32 → channel-wise codes over the token axis (round half to even, as torch's)."""
    qmax = _QMAX[level]
    x = np.asarray(x, dtype=np.float32)
    lo = x.min(axis=2, keepdims=True).astype(np.float16)
    lo32 = lo.astype(np.float32)
    scale = np.maximum((x.max(axis=2, keepdims=True) - lo32) / np.float32(qmax), np.float32(1e-4)).astype(np.float16)
    q = np.clip(np.rint((x - lo32) / scale.astype(np.float32)), 0, qmax).astype(np.uint8)
    if level == "int4":
        if x.shape[-1] % 2:
            raise ValueError(f"INT4 packs pairs along the last axis: it must be even, got {x.shape[-1]}")
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return QTensor(level, np.ascontiguousarray(q), lo, scale, tuple(x.shape))


def dequantize(q: QTensor) -> np.ndarray:
    """Float32 [L, H, n, D] of a quantised array."""
    codes = q.codes
    if q.level == "int4":
        codes = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
    return codes.astype(np.float32) * q.scale.astype(np.float32) + q.lo.astype(np.float32)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Softmax(q k^T / sqrt(D)) v over the last two axes, unmasked, float32 (as torch's scaled_dot_product_attention
    computed it here before)."""
    s = (q @ np.swapaxes(k, -1, -2)) * np.float32(1 / np.sqrt(q.shape[-1]))
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return s @ v


def _relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref) / max(float(np.linalg.norm(ref)), 1e-12))


def attention_error(k: np.ndarray, v: np.ndarray, k2: np.ndarray, v2: np.ndarray) -> float:
    """Relative L2 error of attention outputs over the chunk (probe queries = the float keys)."""
    return _relative_error(_attention(k, k2, v2), _attention(k, k, v))


def compress(k: np.ndarray, v: np.ndarray, tolerance: float) -> tuple[QTensor, QTensor, float]:
    """The fewest-bits level whose measured attention-output error is <= `tolerance` (INT8 if none).

    Returns quantised K and V and the measured error of the chosen level.
    """
    ref = _attention(k, k, v)  # the float output, once for every level tried
    for level in LEVELS:
        if level == "int4" and k.shape[-1] % 2:
            continue  # an odd head dimension has no INT4 pairs
        qk, qv = quantize(k, level), quantize(v, level)
        err = _relative_error(_attention(k, dequantize(qk), dequantize(qv)), ref)
        if err <= tolerance or level == LEVELS[-1]:
            return qk, qv, err
    raise AssertionError("unreachable")
