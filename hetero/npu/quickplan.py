"""A stand-in quantization plan from absmax scales of one float forward (no shadows, no pruning).

For benchmarks and tests of the NPU path when no calibration artifact exists: the real plan comes
from `hetero.outliers.pruning.plan_from_calibration` (calibration + shadow outliers + pruning), which `NpuBackend`
takes as is. Scale of a site = absmax of its activations over `ids` / 127 (`quantize.symmetric_scale`).
"""

from __future__ import annotations

from hetero.chunking import token_ids
from hetero.outliers.plan import QuantPlan, plan_from_scales
from hetero.outliers.quantize import symmetric_scale


def absmax_plan(model, ids: object, shadow: dict | None = None, weight_form: str | None = None) -> QuantPlan:
    """`QuantPlan` with per-site absmax scales measured on one float forward (torch) of `ids`
    (`chunking.token_ids`; weights: `weight_form`)."""
    import torch

    from hetero.model import FloatLinear, observed, run_layers
    from hetero.torch_backends import TorchBackend

    scales: dict[tuple[int, str], float] = {}

    def put(layer: int, site: str, x: torch.Tensor) -> None:
        scales[(layer, site)] = symmetric_scale(float(x.abs().max()), 127)

    cfg, w = model.config, model.weights
    ids = torch.from_numpy(token_ids(ids, cfg.vocab))
    with torch.inference_mode():
        run_layers(cfg, w, ids, TorchBackend(cfg, w, observed(FloatLinear(w), put)))
    return plan_from_scales(model, scales, shadow, method="absmax-standin", weight_form=weight_form)
