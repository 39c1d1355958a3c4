"""A stand-in quantization plan from absmax scales of one float forward (no shadows, no pruning).

For benchmarks and tests of the NPU path when no calibration artifact exists: the real plan comes
from `hetero.outliers.plan.build_plan` (calibration + shadow outliers + pruning), which `NpuBackend`
takes as is. Scale of a site = absmax of its activations over `ids` / 127 (`quantize.symmetric_scale`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero import model as ref
from hetero.outliers.plan import plan_from_scales
from hetero.outliers.quantize import symmetric_scale


@torch.inference_mode()
def absmax_plan(model, ids: torch.Tensor, shadow: dict | None = None, weight_form: str | None = None):
    """`QuantPlan` with per-site absmax scales measured on one float forward of `ids` (weights: `weight_form`)."""
    cfg, w = model.config, model.weights
    ids = torch.as_tensor(ids).long().flatten()
    t = ids.numel()
    rope = ref.RopeTable(cfg, t)
    h = ref.embed(w, ids)
    scales = {}

    def put(layer: int, site: str, x: torch.Tensor) -> None:
        scales[(layer, site)] = symmetric_scale(float(x.abs().max()), 127)

    for layer, lw in enumerate(w.layers):
        x = ref.rms_norm(h, lw.attn_norm, cfg.rms_eps)
        put(layer, "attn_in", x)
        q, k, v = ref.qkv(cfg, lw, h)
        kc = torch.zeros(cfg.n_kv_heads, t, cfg.head_dim)
        a = ref.attention(cfg, q, k, v, rope, kc, torch.zeros_like(kc), 0, t)
        put(layer, "o_in", a)
        h1 = h + F.linear(a, lw.wo)
        x = ref.rms_norm(h1, lw.ffn_norm, cfg.rms_eps)
        put(layer, "ffn_in", x)
        put(layer, "down_in", F.silu(F.linear(x, lw.w_gate)) * F.linear(x, lw.w_up))
        h = ref.o_ffn(cfg, lw, a, h)
    return plan_from_scales(model, scales, shadow, method="absmax-standin", weight_form=weight_form)
