"""Shadow outlier execution (mllm-NPU §3.3, Eq. 1): W8A8 per tensor on the NPU + float outliers on the CPU.

x·W_deqᵀ ≈ s·clip(rint(x/s), -128, 127)·W_deqᵀ (NPU part, `npu_part`) + r[:, c]·W_deq[:, c]ᵀ (CPU part,
`shadow_part`) with r = x − clip(x, −128·s, 127·s), channels c found at run time. `QuantizedBackend` is
`hetero.model`'s layer with this as its site linear: the reference the NPU graphs are checked against.
Derivation: docs/design.md, "Outliers".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from hetero.torch_backends import TorchBackend
from hetero.config import ModelConfig
from hetero.weights import SITE_BIASES, SITE_LINEARS, Weights
from hetero.outliers.a16 import a16_part
from hetero.outliers.plan import QuantPlan, SiteQuant
from hetero.outliers.quantize import (
    ACT_QMAX,
    ACT_QMIN,
    ACT_ZERO_POINT,
    QuantWeight,
    QuantWeightPerChannel,
    quantize_act,
)
from hetero.outliers.rangecheck import rows_inside, split_beyond
from hetero.outliers.rowscale import row_part
from hetero.outliers.rotate import block_hadamard

# float32 sums of integers are exact while every partial sum stays below 2^24: |a·w| <= 128·127, so a
# K-block of at most 2^24 / (128·127) = 1032 channels is exact in any summation order (BLAS included).
_EXACT_K = (1 << 24) // (128 * 127)


def quantize_act_torch(x: torch.Tensor, s: float) -> torch.Tensor:
    """int8 activation values q = clip(rint(x/s), -128, 127) as float32 [T, in] (via `quantize_act`)."""
    u8 = quantize_act(x.detach().cpu().numpy(), s)
    return torch.from_numpy(u8.astype(np.float32) - np.float32(ACT_ZERO_POINT))


def int8_acc(q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """Exact int32 accumulator q @ w_qᵀ ([T, in] × [out, in] → [T, out], float64 holding integers).

    q, w_q: float32 tensors holding int8 values. Equals `quantize.int8_matmul` bit for bit: each
    K-block of <= 1032 channels is exact in float32, the blocks are summed in float64 (|acc| < 2^53).
    """
    k = q.shape[-1]
    if k <= _EXACT_K:
        return (q @ w_q.T).double()
    acc = torch.zeros(q.shape[0], w_q.shape[0], dtype=torch.float64)
    for lo in range(0, k, _EXACT_K):
        acc += (q[:, lo : lo + _EXACT_K] @ w_q[:, lo : lo + _EXACT_K].T).double()
    return acc


def output_scale(s_x: float, w: QuantWeight | QuantWeightPerChannel) -> np.float32 | np.ndarray:
    """The float32 multiplier s_x·s_w of a quantized linear, exactly as `quantize.int8_linear`
    (a float32 [out] vector for per-channel weights, as `quantize.int8_linear_per_channel`)."""
    if isinstance(w, QuantWeightPerChannel):
        return np.float32(s_x) * w.scales.astype(np.float32)
    return np.float32(np.float32(s_x) * np.float32(w.scale))


def npu_part(
    x: torch.Tensor, s: float, weights: Sequence[QuantWeight | QuantWeightPerChannel], biases: Sequence[torch.Tensor | None] = ()
) -> list[torch.Tensor]:
    """W8A8 per-tensor linears sharing the input x [T, in]: float32(acc)·(s·s_w) (+ bias), one per weight.

    Bit-identical to `[quantize.int8_linear(x, s, w, b) for w, b in zip(weights, biases)]`
    (`int8_linear_per_channel` for per-channel weights).
    """
    q = quantize_act_torch(x, s)
    w_q = torch.from_numpy(np.concatenate([w.q for w in weights], axis=0).astype(np.float32))
    y = int8_acc(q, w_q).float()  # int32 -> float32 and float64 -> float32 round alike (exact ints)
    outs = list(torch.split(y, [w.q.shape[0] for w in weights], dim=1))
    biases = list(biases) + [None] * (len(weights) - len(biases))
    for i, (w, b) in enumerate(zip(weights, biases)):
        outs[i] = outs[i] * torch.from_numpy(np.asarray(output_scale(s, w)))
        if b is not None:
            outs[i] = outs[i] + b.float()
    return outs


def split_outliers(x: torch.Tensor, s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The beyond-scale part of x as a compact dense tensor (Eq. 1, `extract`).

    Returns (channels, r): channels int64 [k], the input channels where some |x| lies beyond the INT8
    range [-128·s, 127·s]; r float32 [T, k] = x − clip(x, −128·s, 127·s) on those channels.
    """
    return split_beyond(x, ACT_QMIN * float(s), ACT_QMAX * float(s))


class ShadowRows(Protocol):
    """Where the CPU gets the float weight rows of outlier channels: W_deqᵀ rows [k, out_total] of a site."""

    def rows(self, layer: int, site: str, channels: torch.Tensor) -> torch.Tensor: ...


class DenseRows:
    """All rows in RAM: W_deqᵀ of every site, [in, Σ out] (the paper's full float copy, before §3.3's store)."""

    def __init__(self, plan: QuantPlan):
        self.plan = plan
        self._cache: dict[tuple[int, str], torch.Tensor] = {}

    def rows(self, layer: int, site: str, channels: torch.Tensor) -> torch.Tensor:
        key = (layer, site)
        if key not in self._cache:
            self._cache[key] = site_rows(self.plan, layer, site)
        return self._cache[key][channels]


def site_rows(plan: QuantPlan, layer: int, site: str) -> torch.Tensor:
    """W_deqᵀ of all linears of a site, concatenated along outputs: float32 [in, Σ out]. Each value is its
    `dequantize()`'s (q·s_w in float32), transposed while still int8: a quarter of the bytes to move (a
    process's first prefill builds the rows of every shadow site it meets)."""
    ws = [plan.weights[(layer, n)] for n in SITE_LINEARS[site]]
    q_t = np.ascontiguousarray(np.concatenate([w.q for w in ws], axis=0).T)  # int8 [in, Σ out]
    scales = np.concatenate([w.scales.astype(np.float32) if isinstance(w, QuantWeightPerChannel)
                             else np.full(w.q.shape[0], np.float32(w.scale), np.float32) for w in ws])
    return torch.from_numpy(q_t.astype(np.float32) * scales[None, :])


def shadow_part(x: torch.Tensor, sq: SiteQuant, w_rows) -> torch.Tensor | None:
    """The CPU side of Eq. 1 for one site: r[:, c] @ W_deq[:, c]ᵀ → [T, Σ out], or None if nothing to do.

    w_rows: a [in, Σ out] tensor (all rows, e.g. `site_rows`) or a callable channels -> [k, Σ out]
    (a hot-channel store). Returns None when the site is pruned or no value lies beyond the scale.
    """
    if not sq.shadow:
        return None
    channels, r = split_outliers(x, sq.scale)  # one compiled pass: most decode site inputs have no outlier
    if channels.numel() == 0:
        return None
    rows = w_rows[channels] if isinstance(w_rows, torch.Tensor) else w_rows(channels)
    return r @ rows


class QuantizedBackend(TorchBackend):
    """W8A8 per-tensor static subgraphs with shadow outliers: the reference the NPU graphs match.

    `hetero.model`'s layer with `site_linear` = `linear_int8` (the NPU part, `npu_part`) +
    `shadow_correction` (the CPU part, `shadow_part`). `rows` supplies the float weight rows of outlier
    channels (default: all in RAM; `hotstore.HotChannelStore` keeps only hot rows in RAM). `stats`, if
    set to a dict, counts shadow work per site.
    """

    name = "w8a8-shadow"

    def __init__(self, cfg: ModelConfig, weights: Weights, plan: QuantPlan, rows: ShadowRows | None = None):
        super().__init__(cfg, weights, self.site_linear)
        self.plan = plan
        self.rows = rows if rows is not None else DenseRows(plan)
        self.stats: dict[tuple[int, str], list[int]] | None = None  # (layer, site) -> [calls, channels]

    def site_input(self, site: str, x: torch.Tensor) -> torch.Tensor:
        """x·T on a site with an online transform (`plan.online`, `rotate.block_hadamard`), else x."""
        block = self.plan.online.get(site)
        return x if block is None else block_hadamard(x, block)

    def linear_int8(self, layer: int, site: str, x: torch.Tensor) -> list[torch.Tensor]:
        """NPU part: the INT8 linears of `site` on x [T, in] (bias included), one [T, out] per linear."""
        lw = self.weights.layers[layer]
        ws = [self.plan.weights[(layer, n)] for n in SITE_LINEARS[site]]
        bs = [getattr(lw, b) if b else None for b in SITE_BIASES[site]]
        sq, x = self.plan.sites[(layer, site)], self.site_input(site, x)
        if sq.per_row:
            return row_part(x, ws, bs)
        return (a16_part if sq.bits == 16 else npu_part)(x, sq.scale, ws, bs)

    def shadow_delta(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor | None:
        """CPU part: the float outlier matmul of `site`, [T, Σ out] over its linears, or None."""
        sq = self.plan.sites[(layer, site)]
        if not sq.shadow:
            return None
        x = self.site_input(site, x)
        y = shadow_part(x, sq, lambda c: self.rows.rows(layer, site, c))
        if self.stats is not None and sq.shadow:
            st = self.stats.setdefault((layer, site), [0, 0])
            st[0] += 1
            st[1] += 0 if y is None else int((x.abs() > sq.scale * ACT_QMAX).any(0).sum())
        return y

    def shadow_delta_rows(self, layer: int, site: str, x: torch.Tensor) -> torch.Tensor | None:
        """`shadow_delta` of each row alone, with its own outlier channels (a decode step's rows: a token tree's
        row gets the correction a one-row step computes, bit for bit; over more rows the union of their channels
        and the matmul's blocking round differently). None when no row has an outlier.

        Most rows of a decode step have none: one compiled range check of all rows (`rows_maybe_beyond`) leaves
        only the rows that may have one to the per-row computation."""
        sq = self.plan.sites[(layer, site)]
        if not sq.shadow:
            return None
        rows = self.rows_maybe_beyond(site, sq, x)
        ys = {i: self.shadow_delta(layer, site, x[i : i + 1]) for i in rows}
        if x.shape[0] == 1:
            return ys.get(0)
        width = next((y.shape[1] for y in ys.values() if y is not None), None)
        if width is None:
            return None
        out = x.new_zeros(x.shape[0], width)
        for i, y in ys.items():
            if y is not None:
                out[i] = y[0]
        return out

    def rows_maybe_beyond(self, site: str, sq: SiteQuant, x: torch.Tensor) -> list[int]:
        """Rows of x whose site input, transformed alone, may lie beyond the INT8 range: every row that
        `shadow_delta` of that row alone would correct, and maybe a few more (`rangecheck.rows_inside`: one
        compiled pass, with a margin for the transform's rounding)."""
        lo, hi = ACT_QMIN * float(sq.scale), ACT_QMAX * float(sq.scale)
        return np.flatnonzero(~rows_inside(x, lo, hi, self.plan.online.get(site))).tolist()

    def shadow_correction(self, layer: int, site: str, x: torch.Tensor) -> list[torch.Tensor] | None:
        """`shadow_delta` split per linear of the site, or None (pruned / no outlier)."""
        y = self.shadow_delta(layer, site, x)
        if y is None:
            return None
        return list(torch.split(y, [self.plan.weights[(layer, n)].q.shape[0] for n in SITE_LINEARS[site]], dim=1))

    def site_linear(self, layer: int, site: str, x: torch.Tensor) -> list[torch.Tensor]:
        ys = self.linear_int8(layer, site, x)
        extra = self.shadow_correction(layer, site, x)
        return ys if extra is None else [y + e for y, e in zip(ys, extra)]
