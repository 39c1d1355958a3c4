"""W8A8 with a scale per row found at run time: what a shadow outlier site (mllm-NPU §3.3, Eq. 1) becomes where
the INT8 graphs' provider can compute a scale per row, the ONNX Runtime CPU EP.

mllm-NPU keeps one static scale per tensor because an NPU's graphs need it; the values beyond that scale then run
in float on the CPU (the shadow). On a host whose "NPU" is the CPU itself the graph can find each row's absmax m
and quantize q = clip(rint(x · (127 / m)), -128, 127): an outlier then coarsens only its own row's grid, and the
product needs no float correction. Measured on the default rotated model
(docs/journal.md, "Issue 24 (session 15)"): the plan's 18 shadow sites with per-row scales give the same perplexity
as with shadows (+0.03% vs +0.02% on layer ops), and the shadows were 10–13% of a prefill, most of it the 12 kept
down_in sites. The default takes it there only: at o_in too it turned a sure answer of tests/test_accuracy.py. The
plan keeps which sites need it (importance pruning, §3.3); QNN HTP's static graphs keep the shadows
(`methods.Recipe.row_scales`).

The float32 ops, in order, are the graph's (`npu.site_ops.row_scaled`), so the graph matches this bit for bit:
m = max(max|x_row|, tiny); xs = x · (127 / m); q = rint(xs) (half to even, saturated); y = float32(acc) · s_w ·
(m · (1/127)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hetero.outliers.quantize import ACT_QMAX, ACT_QMIN

if TYPE_CHECKING:
    import torch

ROW_QMAX = np.float32(ACT_QMAX)  # a row's absmax maps to 127
ROW_TINY = np.float32(1e-30)  # a row of zeros: m = tiny, every q = 0
ROW_INV_QMAX = np.float32(1.0) / ROW_QMAX  # float32(1/127), the graph's constant


def row_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, m): q float32 [T, in] holding int8 values, m float32 [T, 1] each row's absmax (at least `ROW_TINY`)."""
    import torch

    x = x.float()
    m = torch.clamp(x.abs().amax(dim=-1, keepdim=True), min=float(ROW_TINY))
    xs = x * (torch.tensor(ROW_QMAX) / m)
    return torch.clamp(torch.round(xs), ACT_QMIN, ACT_QMAX), m


def row_part(x: torch.Tensor, weights, biases=()) -> list[torch.Tensor]:
    """The per-row-scaled INT8 linears sharing x [T, in], one [T, out] per weight (bias added last): the reference of
    the graph's ops, bit for bit (the integer accumulators exact in float64, below 2^53, as `a16.a16_part`'s)."""
    import torch

    q, m = row_quantize(x)
    w_q = torch.from_numpy(np.concatenate([w.q for w in weights], axis=0).astype(np.float64))
    acc = (q.double() @ w_q.T).float()
    row_s = m * torch.tensor(ROW_INV_QMAX)
    outs, col = [], 0
    biases = list(biases) + [None] * (len(weights) - len(biases))
    for w, b in zip(weights, biases):
        n = w.q.shape[0]
        sw = torch.from_numpy(np.asarray(w.scales if hasattr(w, "scales") else np.float32(w.scale), np.float32))
        y = acc[:, col:col + n] * sw * row_s
        outs.append(y if b is None else y + b.float())
        col += n
    return outs
