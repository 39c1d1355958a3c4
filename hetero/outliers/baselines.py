"""Baseline quantizers of mllm-NPU Table 5 (§4.4) as `LayerBackend`s, for the accuracy benchmark.

Fake-quantized in float32 torch (accuracy only, no INT8 kernel): SmoothQuant (α = 0.5), LLM.int8()
(threshold 6.0), per-group INT8 (group 32). Each is `hetero.model`'s layer with its own `site_linear`.
"""

from __future__ import annotations

import torch

from hetero.torch_backends import TorchBackend
from hetero.weights import SITE_BIASES, SITE_LINEARS
from hetero.outliers.quantize import fake_quant as _fq


def _absmax_scale(x: torch.Tensor, dim) -> torch.Tensor:
    return (x.abs().amax(dim=dim, keepdim=True) / 127.0).clamp_min(1e-12)


class _FakeQuantBackend(TorchBackend):
    """`hetero.model`'s layer; subclasses give `site_linear`."""

    def __init__(self, cfg, weights):
        super().__init__(cfg, weights, self.site_linear)
        self._w: dict[tuple[int, str], torch.Tensor] = {}  # concatenated float weights [Σout, in]
        self._split: dict[tuple[int, str], list[int]] = {}
        for layer, lw in enumerate(weights.layers):
            for site, names in SITE_LINEARS.items():
                ws = [getattr(lw, n) for n in names]
                self._w[(layer, site)] = torch.cat(ws, 0)
                self._split[(layer, site)] = [w.shape[0] for w in ws]

    def _finish(self, layer: int, site: str, y: torch.Tensor) -> list[torch.Tensor]:
        outs = list(torch.split(y, self._split[(layer, site)], dim=1))
        lw = self.weights.layers[layer]
        for i, b in enumerate(SITE_BIASES[site]):
            bias = getattr(lw, b) if b else None
            if bias is not None:
                outs[i] = outs[i] + bias
        return outs


class SmoothQuantBackend(_FakeQuantBackend):
    name = "smoothquant"

    def __init__(self, cfg, weights, calibration, alpha: float = 0.5):
        super().__init__(cfg, weights)
        self.smooth, self.act_scale, self.wq = {}, {}, {}
        for key, w in self._w.items():
            xmax = torch.from_numpy(calibration.sites[key].channel_absmax).clamp_min(1e-5)
            wmax = w.abs().amax(0).clamp_min(1e-5)
            s = xmax.pow(alpha) / wmax.pow(1 - alpha)
            self.smooth[key] = s
            self.act_scale[key] = float((xmax / s).max()) / 127.0
            ws = w * s  # [Σout, in]
            parts = torch.split(ws, self._split[key], 0)  # per-tensor scale per linear
            self.wq[key] = torch.cat([_fq(p, _absmax_scale(p, None)) for p in parts], 0)

    def site_linear(self, layer, site, x):
        key = (layer, site)
        xs = _fq(x / self.smooth[key], torch.tensor(self.act_scale[key]), -128, 127)
        return self._finish(layer, site, xs @ self.wq[key].T)


class LLMInt8Backend(_FakeQuantBackend):
    name = "llm_int8"

    def __init__(self, cfg, weights, threshold: float = 6.0):
        super().__init__(cfg, weights)
        self.threshold = threshold
        self.wq = {k: _fq(w, _absmax_scale(w, 1)) for k, w in self._w.items()}  # per output row
        self.outlier_channels: list[int] = []

    def site_linear(self, layer, site, x):
        key = (layer, site)
        cols = (x.abs() > self.threshold).any(0)
        self.outlier_channels.append(int(cols.sum()))
        x_in = x.masked_fill(cols, 0.0)
        y = _fq(x_in, _absmax_scale(x_in, 1)) @ self.wq[key].T
        if cols.any():
            y = y + x[:, cols] @ self._w[key][:, cols].T
        return self._finish(layer, site, y)


class PerGroupBackend(_FakeQuantBackend):
    name = "per_group"

    def __init__(self, cfg, weights, group: int = 32):
        super().__init__(cfg, weights)
        self.group = group
        self.wq = {k: self._group_fq(w) for k, w in self._w.items()}

    def _group_fq(self, x: torch.Tensor) -> torch.Tensor:
        rows, n = x.shape
        g = x.reshape(rows, n // self.group, self.group)
        return _fq(g, _absmax_scale(g, 2)).reshape(rows, n)

    def site_linear(self, layer, site, x):
        return self._finish(layer, site, self._group_fq(x) @ self.wq[(layer, site)].T)
