"""RoPE's cos/sin tables, as numpy arrays: the runtime binds them to its attention graphs and decode kernels,
and the float reference (`model`) rotates torch rows with views of the same tables (`RopeTable.apply`).

Computed without torch so that a warm INT8 start never imports it: the angles are float32 products
pos·inv_freq (as HF Llama computes them), their cos/sin evaluated in float64 and rounded once to float32.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from hetero import buffers
from hetero.config import ModelConfig

if TYPE_CHECKING:
    import torch


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """RoPE frequencies [R/2] float32 of the rotated dims (cfg.rotary_dim) with the model's theta and scaling
    ("linear", Llama 3.1's "llama3", Phi-3's "longrope", GGUF's per-frequency divisors "freqs"); local: those of
    the windowed layers with their own base (Gemma 3), unscaled."""
    d = cfg.rotary_dim
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    sc = {} if local else cfg.rope_scaling
    kind = sc.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_ctx = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = np.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "longrope":  # Phi-3's, in its short regime (`config.longrope`)
        inv = inv / np.asarray(sc["short_factor"], dtype=np.float64)
    elif kind == "freqs":  # llama.cpp's rope_freqs (Llama 3.x GGUF): one divisor per frequency
        factors = np.asarray(sc["factors"], dtype=np.float64)
        if factors.size != inv.size:
            raise ValueError(f"rope_freqs has {factors.size} factors for {inv.size} frequencies")
        inv = inv / factors
    return inv.astype(np.float32)


def _cos_sin(max_len: int, inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [max_len, R/2] float32, aligned for the attention kernels that read them (`hetero.buffers`)."""
    angles = np.outer(np.arange(max_len, dtype=np.float32), inv).astype(np.float64)  # float32 products
    return buffers.aligned(np.cos(angles).astype(np.float32)), buffers.aligned(np.sin(angles).astype(np.float32))


class RopeTable:
    """cos/sin [max_len, R/2] float32 for every position up to `max_len`, computed once (rotate-half layout, as HF
    Llama); a model whose windowed layers have their own base (Gemma 3) has a second table (`local_cos/sin`)."""

    def __init__(self, cfg: ModelConfig, max_len: int):
        self.cos, self.sin = _cos_sin(max_len, rope_inv_freq(cfg))  # both halves share these angles
        attention = cfg.rope_scaling.get("attention_factor", 1.0)  # longrope scales cos/sin (as transformers)
        if attention != 1.0:
            self.cos *= np.float32(attention)
            self.sin *= np.float32(attention)
        self.local_cos: np.ndarray | None = None
        self.local_sin: np.ndarray | None = None
        if cfg.local_rope_theta:
            self.local_cos, self.local_sin = _cos_sin(max_len, rope_inv_freq(cfg, local=True))
        self.cfg = cfg

    def tables(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) [max_len, R/2] of layer `layer`."""
        if self.cfg.local_rope(layer):
            return self.local_cos, self.local_sin  # type: ignore[return-value]
        return self.cos, self.sin

    def apply(self, x: "torch.Tensor", start: int, positions: "torch.Tensor | None" = None,
              layer: int = 0) -> "torch.Tensor":
        """x: [H, T, D] torch rows at positions start..start+T-1 (or at `positions` [T]) → x·cos + rotate_half(x)·sin
        on the first cfg.rotary_dim dims (the rest pass, Phi's partial rotary), term for term as HF."""
        import torch

        cos, sin = (torch.from_numpy(t) for t in self.tables(layer))
        t = x.shape[1]
        if positions is None:
            cos, sin = cos[start : start + t], sin[start : start + t]
        else:
            cos, sin = cos[positions], sin[positions]
        half = cos.shape[-1]
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        rot = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        return torch.cat(rot if 2 * half == x.shape[-1] else rot + [x[..., 2 * half :]], dim=-1)
