"""Symmetric INT8 quantization and the numpy INT8 reference of a quantized linear (mllm-NPU §3.3).

Activations per tensor, int8 in [-128, 127] stored as uint8 with zero point 128; weights int8 with zero
point 0, per output channel by default (static scales fold into the output dequantization), in
[-weight_qmax, weight_qmax], multiplied on the CPU EP as the plan's weight form says (`WEIGHT_FORMS`,
chosen per CPU by `hetero.npu.isa`). Rounding is half to even, as ONNX `QuantizeLinear`. Derivations:
docs/design.md, "Outliers"; docs/journal.md, "Weight forms".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hetero.errors import ConfigError

if TYPE_CHECKING:
    import torch

ACT_ZERO_POINT = 128  # uint8 storage of int8 activations
ACT_QMIN, ACT_QMAX = -128, 127
W_QMAX = 127  # full 8-bit symmetric weights
# Largest |q| for which ORT's u8·s8 GEMM cannot saturate on AVX2 (vpmaddubsw int16 pair sums):
# 2·255·64 = 32640 <= 32767, while 2·255·65 = 33150 > 32767.
U8S8_SAFE_WEIGHT_ABSMAX = 64
W_QMAX_U8S8 = 63  # 7-bit symmetric weights (ORT reduce_range)


@dataclass(frozen=True, slots=True)
class WeightForm:
    """How a plan's INT8 weights are stored and multiplied on the ONNX Runtime CPU EP."""

    qmax: int  # weights q in [-qmax, qmax]
    kernel: str  # "u8s8" (s8 weights, zero point 0) | "u8u8" (weights stored q + 128, zero point 128)
    needs_vnni: bool  # exact only with a VNNI dot product (`hetero.npu.isa`)


WEIGHT_FORMS: dict[str, WeightForm] = {
    "w8-u8s8": WeightForm(W_QMAX, "u8s8", True),  # VNNI: exact and fastest
    "w7-u8s8": WeightForm(W_QMAX_U8S8, "u8s8", False),  # exact everywhere (ORT reduce_range), 7-bit
    "w8-u8u8": WeightForm(W_QMAX, "u8u8", False),  # exact everywhere, 8-bit; slower on AVX2
}


def check_weight_form(form: str) -> str:
    """`form` must name one of `WEIGHT_FORMS`."""
    if form not in WEIGHT_FORMS:
        raise ConfigError(f"weight form must be one of {sorted(WEIGHT_FORMS)}, got {form!r}")
    return form


def form_for_qmax(qmax: int) -> str:
    """The form a plan given only `qmax` gets: u8·s8 where it is exact on every x86 CPU, else u8·u8."""
    return "w7-u8s8" if qmax <= U8S8_SAFE_WEIGHT_ABSMAX else "w8-u8u8"


def check_weight_qmax(qmax: int) -> int:
    """qmax of symmetric int8 weights must be an integer in [1, 127]."""
    if isinstance(qmax, bool) or not isinstance(qmax, (int, np.integer)) or not 1 <= int(qmax) <= W_QMAX:
        raise ConfigError(f"weight_qmax must be an integer in [1, {W_QMAX}], got {qmax!r}")
    return int(qmax)


def symmetric_scale(absmax: float, qmax: int = W_QMAX) -> float:
    """s = absmax / qmax; a tensor of zeros gets s = 1 so that division is always defined."""
    if not np.isfinite(absmax) or absmax < 0:
        raise ConfigError(f"absmax must be a finite value >= 0, got {absmax}")
    return float(absmax) / qmax if absmax > 0 else 1.0


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """An INT8 per-tensor weight, [out, in] like nn.Linear."""

    q: np.ndarray  # int8 [out, in]
    scale: float  # s_w

    def dequantize(self) -> np.ndarray:
        return self.q.astype(np.float32) * np.float32(self.scale)


def quantize_weight(w: np.ndarray, qmax: int = W_QMAX) -> QuantWeight:
    """Symmetric per-tensor INT8 weight: q = rint(W / s_w), s_w = absmax / qmax (127, or 63 for 7-bit)."""
    qmax = check_weight_qmax(qmax)
    w = np.asarray(w, dtype=np.float32)
    s = symmetric_scale(float(np.abs(w).max()) if w.size else 0.0, qmax)
    q = np.clip(np.rint(w / np.float32(s)), -qmax, qmax).astype(np.int8)
    return QuantWeight(q, s)


def quantize_act(x: np.ndarray, s: float) -> np.ndarray:
    """Activation → uint8 with zero point 128: u = clip(rint(x / s), -128, 127) + 128."""
    q = np.clip(np.rint(np.asarray(x, dtype=np.float32) / np.float32(s)), ACT_QMIN, ACT_QMAX)
    return (q + ACT_ZERO_POINT).astype(np.uint8)


def fake_quant(x: "torch.Tensor", scale, qmin: int = -127, qmax: int = 127) -> "torch.Tensor":
    """Fake-quantize in torch: clip(rint(x / scale), qmin, qmax) · scale (scale broadcasts); the accuracy-only
    stand-in of a quantizer (Table 5's baselines, `search`'s damage estimates)."""
    import torch

    return torch.clamp(torch.round(x / scale), qmin, qmax) * scale


def int8_matmul(x_u8: np.ndarray, w: QuantWeight) -> np.ndarray:
    """int32 accumulator of (u8 - 128) @ W_q^T: [T, in] × [out, in] → [T, out] (MatMulInteger)."""
    a = x_u8.astype(np.int32) - ACT_ZERO_POINT
    return a @ w.q.astype(np.int32).T


def int8_linear(x: np.ndarray, s_x: float, w, bias: np.ndarray | None = None) -> np.ndarray:
    """The reference W8A8 linear: float32(int32 acc) · (s_x · s_w) (+ bias), [T, out].

    Multiplying by the single float32 product s_x·s_w mirrors the graph's one scale multiply. A
    `QuantWeightPerChannel` goes to `int8_linear_per_channel` (one float32 product per output column).
    """
    if isinstance(w, QuantWeightPerChannel):
        return int8_linear_per_channel(x, s_x, w, bias)
    acc = int8_matmul(quantize_act(x, s_x), w)
    y = acc.astype(np.float32) * np.float32(np.float32(s_x) * np.float32(w.scale))
    return y if bias is None else y + bias.astype(np.float32)


# ---------------------------------------------------------------- per-output-channel weights (the default)
# Free on NPUs that take axis-quantized weights (QNN HTP, ONNX DequantizeLinear(axis=output dim)): the int32
# accumulation is the same MatMulInteger, only the final multiply becomes one float32 scale per output
# column (weight scales are static and fold into the output dequantization). Activations stay per tensor.


@dataclass(frozen=True, slots=True)
class QuantWeightPerChannel:
    """An INT8 weight with one symmetric scale per output row, [out, in]."""

    q: np.ndarray  # int8 [out, in]
    scales: np.ndarray  # float32 [out]: s_w[o] = absmax(W[o]) / qmax

    def dequantize(self) -> np.ndarray:
        return self.q.astype(np.float32) * self.scales.astype(np.float32)[:, None]


def quantize_weight_per_channel(w: np.ndarray, qmax: int = W_QMAX) -> QuantWeightPerChannel:
    """q[o] = rint(W[o] / s_w[o]), s_w[o] = absmax(W[o]) / qmax (rows of zeros get s = 1)."""
    qmax = check_weight_qmax(qmax)
    w = np.asarray(w, dtype=np.float32)
    amax = np.abs(w).max(axis=1) if w.size else np.zeros(w.shape[0], np.float32)
    s = np.where(amax > 0, amax / np.float32(qmax), 1.0).astype(np.float32)
    q = np.clip(np.rint(w / s[:, None]), -qmax, qmax).astype(np.int8)
    return QuantWeightPerChannel(q, s)


def int8_linear_per_channel(x: np.ndarray, s_x: float, w: QuantWeightPerChannel, bias: np.ndarray | None = None) -> np.ndarray:
    """float32(int32 acc) · float32(s_x · s_w[o]) (+ bias): the per-channel counterpart of `int8_linear`."""
    a = quantize_act(x, s_x).astype(np.int32) - ACT_ZERO_POINT
    acc = a @ w.q.astype(np.int32).T
    y = acc.astype(np.float32) * (np.float32(s_x) * w.scales.astype(np.float32))
    return y if bias is None else y + bias.astype(np.float32)
