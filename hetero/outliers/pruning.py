"""Importance pruning of shadow outliers (mllm-NPU §3.3, "Most outliers can be pruned", Fig. 12).

importance(site) = absmax / s; the shadow is dropped on the least important `prune_fraction` of sites
(paper: 85%), whose beyond-range values are then clipped. `plan_from_calibration` turns
`CalibrationStats` into the `QuantPlan` the backends run. Defaults and their measurements:
docs/design.md, "Outliers".
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from hetero.errors import ConfigError
from hetero.weights import SITES
from hetero.outliers.a16 import a16_scale
from hetero.outliers.calibration import PERCENTILES, SiteStats, ensure_calibration
from hetero.outliers.plan import (
    DEFAULT_WEIGHT_GRANULARITY,
    DEFAULT_WEIGHT_QMAX,
    QuantPlan,
    SiteQuant,
    quantize_weights,
    weight_range,
)

DEFAULT_PRUNE_FRACTION = 0.85
# Shadow sites clip at p99.9 of |x|, pruned ones at p99.999: the measured choice (docs/journal.md, "Outliers").
DEFAULT_PERCENTILE = 99.9
DEFAULT_PRUNED_PERCENTILE = 99.999
DEFAULT_HOT_COVERAGE = 0.8  # hot channels: smallest set covering >= 80% of outlier occurrences (§3.3)


def site_importance(calibration, percentile: float = DEFAULT_PERCENTILE, importance: str = "ratio",
                    pruned_percentile: float = DEFAULT_PRUNED_PERCENTILE) -> dict[tuple[int, str], float]:
    """importance of every site: "ratio" = absmax / s (§3.3, the paper's) or "error" = the relative squared
    error pruning its shadow adds (`SiteStats.pruning_error`, from the calibration histogram)."""
    if importance == "ratio":
        return {k: st.importance(percentile) for k, st in calibration.sites.items()}
    if importance == "error":
        return {k: st.pruning_error(percentile, pruned_percentile) for k, st in calibration.sites.items()}
    raise ConfigError(f"importance must be 'ratio' or 'error', got {importance!r}")


def rank_sites(calibration, percentile: float = DEFAULT_PERCENTILE, granularity: str = "site",
               importance: str = "ratio", pruned_percentile: float = DEFAULT_PRUNED_PERCENTILE) -> list[tuple[int, str]]:
    """(layer, site) keys, most important first (ties by position, for determinism)."""
    imp = site_importance(calibration, percentile, importance, pruned_percentile)
    if granularity == "site":
        return sorted(imp, key=lambda k: (-imp[k], k))
    if granularity == "layer":
        layer_imp = {}
        for (l, _), v in imp.items():
            layer_imp[l] = max(layer_imp.get(l, 0.0), v)
        layers = sorted(layer_imp, key=lambda l: (-layer_imp[l], l))
        return [(l, s) for l in layers for s in SITES]
    raise ConfigError(f"granularity must be 'site' or 'layer', got {granularity!r}")


def kept_sites(calibration, prune_fraction: float = DEFAULT_PRUNE_FRACTION, percentile: float = DEFAULT_PERCENTILE,
               granularity: str = "site", importance: str = "ratio",
               pruned_percentile: float = DEFAULT_PRUNED_PERCENTILE) -> set[tuple[int, str]]:
    """The sites whose shadow survives pruning: the top round((1 - f)·n) units by importance."""
    if not 0.0 <= prune_fraction <= 1.0:
        raise ConfigError(f"prune_fraction must be in [0, 1], got {prune_fraction!r}")
    order = rank_sites(calibration, percentile, granularity, importance, pruned_percentile)
    unit = 1 if granularity == "site" else len(SITES)
    n_units = len(order) // unit
    n_keep = int(math.floor((1.0 - prune_fraction) * n_units + 0.5))
    return set(order[: n_keep * unit])


def hot_channels(counts: np.ndarray, coverage: float = DEFAULT_HOT_COVERAGE) -> tuple[tuple[int, ...], int]:
    """Outlier channels by count (most frequent first) and n_hot, the shortest prefix covering `coverage`."""
    order = np.argsort(-counts, kind="stable")
    order = order[counts[order] > 0]
    if order.size == 0:
        return (), 0
    cum = np.cumsum(counts[order]) / counts[order].sum()
    n_hot = int(np.searchsorted(cum, coverage - 1e-12) + 1)
    return tuple(int(c) for c in order), min(n_hot, order.size)


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """How `plan_from_calibration` turns a calibration into a plan (every field has the measured default).

    Shadow sites get s = t_percentile / 127 and their outlier channels (hot prefix covering `hot_coverage`);
    pruned sites get s = t_pruned_percentile / 127 and no shadow. prune_fraction=0 is "shadow_all",
    prune_fraction=1 "clipped_w8a8"; granularity and importance: `rank_sites`. weight_granularity: "channel"
    (default) gives per-output-channel INT8 weights, whose static scales fold into the output dequantization
    while activations stay per tensor (`quantize` module doc); "tensor" the paper's strict per-tensor weights
    (ablation). weight_qmax: 63 (default, 7-bit weights: exact with ORT's fast u8·s8 MatMulInteger on AVX2,
    `plan` module doc) or 127 (full 8-bit). weight_form (`quantize.WEIGHT_FORMS`), when given, sets the range
    instead and is recorded in the plan (it picks the CPU EP's kernel). a16: (layer, site) keys run W8A16 with
    s = absmax / 32767 and no shadow (`a16`). online: the plan's online transforms (`rotate.online_sites`; the
    calibration must have observed them). method: the name the plan records. row_scales: the sites (of `SITES`) whose
    kept ones run with a scale per row (`rowscale`, "a8r") instead of shadow outliers (CPU EP graphs only). a8r:
    (layer, site) keys that run with a scale per row whether pruning keeps them or not (as a16's, no shadow).
    """

    prune_fraction: float = DEFAULT_PRUNE_FRACTION
    percentile: float = DEFAULT_PERCENTILE
    pruned_percentile: float = DEFAULT_PRUNED_PERCENTILE
    hot_coverage: float = DEFAULT_HOT_COVERAGE
    granularity: str = "site"
    importance: str = "ratio"
    method: str = "w8a8-shadow"
    weight_granularity: str = DEFAULT_WEIGHT_GRANULARITY
    weight_qmax: int = DEFAULT_WEIGHT_QMAX
    weight_form: str | None = None
    a16: Collection[tuple[int, str]] = ()
    online: Mapping[str, int] | None = None
    row_scales: Collection[str] = ()  # these sites, where kept, scale each row at run time (`rowscale`), no shadow
    a8r: Collection[tuple[int, str]] = ()


def plan_from_calibration(model, calibration=None, options: PlanOptions = PlanOptions()) -> QuantPlan:
    """The hetero quantization plan: calibrated per-tensor scales, shadow on the important sites only.

    calibration: `CalibrationStats` of this model, or None for the cached one (calibrated on first use,
    `calibration.ensure_calibration`); options: `PlanOptions`.
    """
    o = options
    if calibration is None:
        calibration = ensure_calibration(model)
    keep = kept_sites(calibration, o.prune_fraction, o.percentile, o.granularity, o.importance, o.pruned_percentile)
    a16, a8r = set(o.a16), set(o.a8r)
    if a16 & a8r:
        raise ConfigError(f"a site runs either W8A16 or a scale per row, not both: {sorted(a16 & a8r)}")
    bad = set(o.row_scales) - set(SITES)
    if bad:
        raise ConfigError(f"row_scales must name sites of {SITES}, got {sorted(bad)}")

    def kept(site: str) -> SiteChoice:
        return SiteChoice("a8r" if site in o.row_scales else "a8s", o.percentile)

    choices = {key: SiteChoice("a16", 100.0) if key in a16 else SiteChoice("a8r", o.percentile) if key in a8r
               else kept(key[1]) if key in keep
               else SiteChoice("a8", o.pruned_percentile) for key in calibration.sites}
    meta = {"percentile": o.percentile, "pruned_percentile": o.pruned_percentile, "granularity": o.granularity,
            "importance": o.importance}
    return plan_from_choices(model, calibration, choices, o, meta)


@dataclass(frozen=True, slots=True)
class SiteChoice:
    """How one activation site runs: "a8" (W8A8 per tensor, clipped at the p-th percentile of |x|), "a8s"
    (W8A8 scaled to the p-th percentile, beyond it shadow outliers on the CPU, Eq. 1), "a8r" (W8A8 with a scale
    per row at run time, `rowscale`; the p-th percentile's scale recorded) or "a16" (W8A16)."""

    kind: str
    percentile: float

    def __post_init__(self) -> None:
        if self.kind not in ("a8", "a8s", "a8r", "a16"):
            raise ConfigError(f"a site's precision must be 'a8', 'a8s', 'a8r' or 'a16', got {self.kind!r}")
        if not any(abs(self.percentile - p) < 1e-9 for p in PERCENTILES):
            raise ConfigError(f"a site's percentile must be one of the calibrated {PERCENTILES}, got {self.percentile!r}")

    def site_quant(self, st: SiteStats, hot_coverage: float = DEFAULT_HOT_COVERAGE) -> SiteQuant:
        """This choice on a site with calibration `st` (importance is informational: absmax / s at p99.9)."""
        imp = st.importance(DEFAULT_PERCENTILE)
        if self.kind == "a16":
            return SiteQuant(a16_scale(st.absmax), importance=imp, bits=16)
        if self.kind == "a8s":
            channels, n_hot = hot_channels(st.channel_counts(self.percentile), hot_coverage)
            return SiteQuant(st.scale(self.percentile), channels, n_hot, imp)
        return SiteQuant(st.scale(self.percentile), (), 0, imp, per_row=self.kind == "a8r")


def plan_from_choices(model, calibration, choices: Mapping[tuple[int, str], SiteChoice],
                      options: PlanOptions = PlanOptions(method="w8a8-choices", prune_fraction=0.0),
                      meta: Mapping | None = None) -> QuantPlan:
    """The plan running every site as `choices` says (`SiteChoice`); of `options` (`PlanOptions`) it uses the
    weights' form (granularity, qmax or form, online transforms), hot_coverage, and the method and
    prune_fraction it records. The INT8 weights are the model's, computed once per form (`weightcache`)."""
    o = options
    weight_qmax, weight_form = weight_range(o.weight_qmax, o.weight_form)
    calibration.validate_for(model)
    if set(choices) != set(calibration.sites):
        raise ConfigError(f"choices must cover every calibrated site ({len(calibration.sites)}), got {len(choices)}")
    sites = {key: choices[key].site_quant(st, o.hot_coverage) for key, st in calibration.sites.items()}
    meta = {**(meta or {}), "hot_coverage": o.hot_coverage, "calibration_corpus": calibration.corpus,
            "calibration_tokens": calibration.n_tokens}
    online = dict(o.online or {})
    weights = quantize_weights(model, o.weight_granularity, weight_qmax, online)
    return QuantPlan(sites, weights, model.fingerprint, o.method, float(o.prune_fraction), meta, o.weight_granularity,
                     weight_qmax, weight_form, online)
