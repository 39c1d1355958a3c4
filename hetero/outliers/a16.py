"""W8A16 per tensor: 16-bit activations × the plan's INT8 weights, exact on integer-only INT8 kernels.

A site whose per-tensor INT8 grid loses too much (such as `down_in`) keeps 16-bit activations
q = clip(rint(x/s), -32768, 32767) with s = absmax / 32767. QNN HTP runs W8A16 natively; the ONNX
Runtime CPU EP has no 16-bit MatMulInteger, so q is split into bytes, q = 256·hi + lo with hi in
[-128, 127] (stored u8, zero point 128) and lo in [0, 255] (u8, zero point 0), and runs as two u8
`MatMulInteger` passes with the same weights: int32 accumulators acc_hi, acc_lo, each exact. The
float32 result is acc_hi·(256·s·s_w) + acc_lo·(s·s_w), written the same way here and in the graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

A16_QMAX = 32767
A16_QMIN = -32768


def a16_scale(absmax: float) -> float:
    """s = absmax / 32767 (1 for an all-zero site)."""
    return float(absmax) / A16_QMAX if absmax > 0 else 1.0


def split_bytes(x: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) as float32 integer values: q = clip(rint(x/s)) = 256·hi + lo, hi in [-128, 127], lo in [0, 255]."""
    import torch

    q = torch.clamp(torch.round(x.float() / np.float32(s)), A16_QMIN, A16_QMAX)  # round half to even
    hi = torch.floor(q / 256)
    return hi, q - 256 * hi


def a16_out_scales(s_x: float, w_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (256·s·s_w, s·s_w), [out] or scalar, as the graph's two Mul constants."""
    import torch

    sw = torch.as_tensor(np.asarray(w_scale, np.float32))
    lo = torch.as_tensor(np.float32(s_x)) * sw
    return lo * np.float32(256), lo


def a16_combine(acc_hi: torch.Tensor, acc_lo: torch.Tensor, s_x: float, w_scale) -> torch.Tensor:
    """float32 acc_hi·(256·s·s_w) + acc_lo·(s·s_w) (accumulators as exact integer-valued tensors)."""
    k_hi, k_lo = a16_out_scales(s_x, w_scale)
    return acc_hi.float() * k_hi + acc_lo.float() * k_lo


def a16_part(x: torch.Tensor, s: float, weights, biases=()) -> list[torch.Tensor]:
    """W8A16 per-tensor linears sharing x [T, in], one [T, out] per weight (bias added after the combine):
    the exact reference of the two-pass graph (each pass a float64 matmul of integers, exact below 2^53)."""
    import torch

    hi, lo = split_bytes(x, s)
    w_q = torch.from_numpy(np.concatenate([w.q for w in weights], axis=0).astype(np.float64))
    acc_hi, acc_lo = hi.double() @ w_q.T, lo.double() @ w_q.T
    outs, col = [], 0
    biases = list(biases) + [None] * (len(weights) - len(biases))
    for w, b in zip(weights, biases):
        n = w.q.shape[0]
        ws = w.scales if hasattr(w, "scales") else np.float32(w.scale)
        y = a16_combine(acc_hi[:, col:col + n], acc_lo[:, col:col + n], s, ws)
        outs.append(y if b is None else y + b.float())
        col += n
    return outs
