"""Per-chunk KV compression: channel-wise INT8 / INT4 chosen by measured attention-output error.

LLMS §3.2 (tolerance-aware compression): chunks differ in how much precision they need, so each chunk
gets the fewest bits whose error stays within a tolerance. The quantiser is LLMS's channel-wise linear
one: a min and a scale per (layer, head, dim) channel over the chunk's tokens; INT4 packs two values a
byte. The error is measured, not assumed: attention with the chunk's own keys as probe queries, float
vs dequantised K/V, relative L2 of the output (a proxy for the real queries, which are not kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LEVELS = ("int4", "int8")  # tried in this order: the fewest bits within the tolerance wins
_QMAX = {"int8": 255, "int4": 15}


@dataclass(frozen=True, slots=True)
class QTensor:
    """A channel-wise quantised [L, H, n, D] tensor: codes (uint8; INT4 packs pairs along D)."""

    level: str
    codes: torch.Tensor  # int8: [L, H, n, D]; int4: [L, H, n, D/2]
    lo: torch.Tensor  # [L, H, 1, D] per-channel minimum (float16: halves the per-channel overhead)
    scale: torch.Tensor  # [L, H, 1, D] (float16)
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.lo, self.scale))


def quantize(x: torch.Tensor, level: str) -> QTensor:
    """x: [L, H, n, D] float → channel-wise codes over the token axis."""
    qmax = _QMAX[level]
    lo = x.amin(dim=2, keepdim=True).half().float()
    scale = ((x.amax(dim=2, keepdim=True) - lo) / qmax).clamp_min(1e-4).half().float()
    q = ((x - lo) / scale).round_().clamp_(0, qmax).to(torch.uint8)
    if level == "int4":
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return QTensor(level, q.contiguous(), lo.half(), scale.half(), tuple(x.shape))


def dequantize(q: QTensor) -> torch.Tensor:
    codes = q.codes
    if q.level == "int4":
        codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
    return codes.float() * q.scale.float() + q.lo.float()


def attention_error(k: torch.Tensor, v: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor) -> float:
    """Relative L2 error of attention outputs over the chunk (probe queries = the float keys)."""
    ref = F.scaled_dot_product_attention(k, k, v)
    out = F.scaled_dot_product_attention(k, k2, v2)
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def compress(k: torch.Tensor, v: torch.Tensor, tolerance: float) -> tuple[QTensor, QTensor, float]:
    """The fewest-bits level whose measured attention-output error is <= `tolerance` (INT8 if none).

    Returns quantised K and V and the measured error of the chosen level.
    """
    for level in LEVELS:
        qk, qv = quantize(k, level), quantize(v, level)
        err = attention_error(k, v, dequantize(qk), dequantize(qv))
        if err <= tolerance or level == LEVELS[-1]:
            return qk, qv, err
    raise AssertionError("unreachable")
