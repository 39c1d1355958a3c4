"""The quantization plan (mllm-NPU §3.3): per activation site its scale and shadow channels, and the INT8
weight of every linear; what a quantized backend runs.

A pure function of the model and the calibration (`pruning.plan_from_calibration`, or `plan_from_scales`);
on disk only the site table is stored (`to_dict`), the INT8 weights are recomputed (`from_dict`).
Sites and the weight range: docs/design.md, "Outliers"; the plan records its weight form ("Weight forms").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from hetero.errors import ConfigError
from hetero.loader import PageReturn
from hetero.weights import SITE_LINEARS, SITES
from hetero.outliers.weightcache import cached_weights
from hetero.outliers.quantize import (
    U8S8_SAFE_WEIGHT_ABSMAX,
    W_QMAX,
    WEIGHT_FORMS,
    QuantWeight,
    QuantWeightPerChannel,
    check_weight_form,
    check_weight_qmax,
    form_for_qmax,
    quantize_weight,
    quantize_weight_per_channel,
)

# Not bumped for weight_qmax: a plan dict without the key was saved with 8-bit weights and `from_dict`
# rebuilds exactly that (weight_qmax=127); plans are not cached on disk by hetero itself.
PLAN_VERSION = 1
DEFAULT_WEIGHT_GRANULARITY = "channel"  # "tensor": the paper's strict per-tensor weights (ablation)
# 8-bit weights (the paper's W8A8); W_QMAX_U8S8 (7-bit) is the CPU-EP fast path (module docstring).
DEFAULT_WEIGHT_QMAX = W_QMAX

@dataclass(frozen=True, slots=True)
class SiteQuant:
    """Quantization of one activation site (the shared input of `SITE_LINEARS[site]`).

    Invariant: scale > 0. The NPU part sees clip(rint(x/s), -128, 127); when `shadow` is on, every
    value beyond [-128·s, 127·s] is extracted at run time (any channel, as the paper's threshold
    comparison) and multiplied in float on the CPU (Eq. 1). A `per_row` site instead scales each row by its
    own absmax at run time (`rowscale`: where the graphs' provider can, the CPU EP); its `scale` is the
    calibrated one, kept for the record.
    """

    scale: float  # s_x: activations quantized as clip(rint(x/s), -128, 127)
    # Calibrated outlier channels, most frequent first; () = no shadow (pruned, §3.3): beyond-scale
    # values are simply clipped. The first `n_hot` are the hot channels whose weight rows stay in RAM.
    shadow_channels: tuple[int, ...] = ()
    n_hot: int = 0
    importance: float = 0.0  # largest calibrated |x| / (127·s) (§3.3, Fig. 12); informational
    bits: int = 8  # activation bits: 8 (W8A8) or 16 (W8A16 per tensor, `a16`: no shadow needed)
    per_row: bool = False  # 8-bit with a scale per row found at run time (`rowscale`: no shadow needed)

    def __post_init__(self) -> None:
        if not (self.scale > 0 and self.scale < float("inf")):
            raise ConfigError(f"SiteQuant.scale must be a finite value > 0, got {self.scale!r}")
        if self.bits not in (8, 16) or (self.bits == 16 and self.shadow_channels):
            raise ConfigError(f"SiteQuant.bits must be 8, or 16 without a shadow; got {self.bits}")
        if self.per_row and (self.bits != 8 or self.shadow_channels):
            raise ConfigError("SiteQuant.per_row needs 8-bit activations and no shadow channels")
        if not 0 <= self.n_hot <= len(self.shadow_channels):
            raise ConfigError(f"SiteQuant.n_hot must be in [0, {len(self.shadow_channels)}], got {self.n_hot}")

    @property
    def shadow(self) -> bool:
        return bool(self.shadow_channels)

    @property
    def hot_channels(self) -> tuple[int, ...]:
        return self.shadow_channels[: self.n_hot]

    def to_dict(self) -> dict:
        return {"scale": self.scale, "shadow_channels": list(self.shadow_channels), "n_hot": self.n_hot,
                "importance": self.importance, "bits": self.bits, "per_row": self.per_row}

    @classmethod
    def from_dict(cls, d: dict) -> "SiteQuant":
        return cls(float(d["scale"]), tuple(int(c) for c in d["shadow_channels"]), int(d.get("n_hot", 0)),
                   float(d.get("importance", 0.0)), int(d.get("bits", 8)), bool(d.get("per_row", False)))


@dataclass(frozen=True, slots=True)
class QuantPlan:
    """Everything a W8A8 backend needs: site scales/shadows and the INT8 weights of every linear."""

    sites: dict[tuple[int, str], SiteQuant]  # (layer, site) -> activation quantization
    # (layer, linear name) -> INT8 weight [out, in]: per output channel (QuantWeightPerChannel, the
    # default) or per tensor (QuantWeight, the paper's strict variant) when weight_granularity == "tensor"
    weights: dict[tuple[int, str], QuantWeight | QuantWeightPerChannel]
    model_fingerprint: str = ""
    method: str = "w8a8-shadow"  # how the scales were chosen (for provenance)
    prune_fraction: float = 0.0
    meta: dict = field(default_factory=dict)
    weight_granularity: str = DEFAULT_WEIGHT_GRANULARITY  # "channel" | "tensor"
    weight_qmax: int = DEFAULT_WEIGHT_QMAX  # weights q in [-weight_qmax, weight_qmax]: 63 (7-bit) or 127
    # how the CPU EP multiplies the weights (`quantize.WEIGHT_FORMS`); "" = `form_for_qmax(weight_qmax)`
    weight_form: str = ""
    # site -> Hadamard block of its online transform (`rotate.online_sites`; {} = none): the site's input is
    # x·T before quantization and its weights are W·T (`quantize_weights`), so the product is unchanged
    online: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_weight_qmax(self.weight_qmax)
        if not self.weight_form:
            object.__setattr__(self, "weight_form", form_for_qmax(self.weight_qmax))
        check_weight_form(self.weight_form)
        if self.weight_form == "w7-u8s8" and self.weight_qmax > U8S8_SAFE_WEIGHT_ABSMAX:
            raise ConfigError(f"weight form w7-u8s8 needs weight_qmax <= {U8S8_SAFE_WEIGHT_ABSMAX}, "
                              f"got {self.weight_qmax}")

    @property
    def n_layers(self) -> int:
        return 1 + max(layer for layer, _ in self.sites)

    def shadow_sites(self) -> list[tuple[int, str]]:
        """Sites whose outliers run on the CPU (the ones importance pruning kept)."""
        return sorted(k for k, sq in self.sites.items() if sq.shadow)

    def to_dict(self) -> dict:
        """The site table only (weights are recomputed from the model in `from_dict`)."""
        return {
            "version": PLAN_VERSION,
            "model_fingerprint": self.model_fingerprint,
            "method": self.method,
            "prune_fraction": self.prune_fraction,
            "meta": self.meta,
            "weight_granularity": self.weight_granularity,
            "weight_qmax": self.weight_qmax,
            "weight_form": self.weight_form,
            "online": self.online,
            "sites": [{"layer": layer, "site": site, **sq.to_dict()} for (layer, site), sq in sorted(self.sites.items())],
        }

    @classmethod
    def from_dict(cls, d: dict, model) -> "QuantPlan":
        """Rebuild a plan saved by `to_dict` for `model` (validated: version, fingerprint, layers)."""
        if d.get("version") != PLAN_VERSION:
            raise ConfigError(f"quantization plan version must be {PLAN_VERSION}, got {d.get('version')!r}")
        fp = d.get("model_fingerprint", "")
        if fp and fp != model.fingerprint:
            raise ConfigError(
                f"quantization plan is for model {fp}, but the model given is {model.fingerprint} ({model.name})"
            )
        sites = {(int(e["layer"]), str(e["site"])): SiteQuant.from_dict(e) for e in d["sites"]}
        _check_sites(sites, model.config.n_layers)
        wg = d.get("weight_granularity", "tensor")  # plans saved before the key existed were per tensor
        qmax = int(d.get("weight_qmax", W_QMAX))  # ... and before weight_qmax existed, 8-bit
        online = {str(k): int(v) for k, v in d.get("online", {}).items()}
        return cls(sites, quantize_weights(model, wg, qmax, online), model.fingerprint, d.get("method", ""),
                   float(d.get("prune_fraction", 0.0)), dict(d.get("meta", {})), wg, qmax, d.get("weight_form", ""),
                   online)


def _check_sites(sites: dict[tuple[int, str], SiteQuant], n_layers: int) -> None:
    want = {(layer, s) for layer in range(n_layers) for s in SITES}
    if set(sites) != want:
        missing, extra = sorted(want - set(sites))[:3], sorted(set(sites) - want)[:3]
        raise ConfigError(f"quantization plan must cover {n_layers} layers x {SITES}; missing {missing}, extra {extra}")


def quantize_weights(model, granularity: str = DEFAULT_WEIGHT_GRANULARITY, qmax: int = DEFAULT_WEIGHT_QMAX,
                     online: dict[str, int] | None = None) -> dict[tuple[int, str], QuantWeight | QuantWeightPerChannel]:
    """INT8 weight of every linear of every layer: per output channel (`quantize.quantize_weight_per_channel`,
    default) or per tensor (`quantize.quantize_weight`), q in [-qmax, qmax]; the linears of `online` sites
    quantize W·T (`rotate.block_hadamard`). Computed once per model and form (`weightcache`)."""
    if granularity not in ("tensor", "channel"):
        raise ConfigError(f"weight_granularity must be 'tensor' or 'channel', got {granularity!r}")
    online = online or {}
    return dict(cached_weights(model, granularity, qmax, online,
                               lambda: _quantize_all(model, granularity, qmax, online)))


def _quantize_all(model, granularity: str, qmax: int, online: dict[str, int]
                  ) -> Iterator[tuple[tuple[int, str], QuantWeight | QuantWeightPerChannel]]:
    """Each linear's INT8 weight in turn, so that they are written to their cache file as they come
    (`weightcache.cached_weights`): never all in memory at once (2.8 GB at 3B, and a serializer's copy as much)."""
    from hetero.outliers.rotate import block_hadamard

    fn = quantize_weight if granularity == "tensor" else quantize_weight_per_channel
    read = PageReturn()  # a quantized float weight need not stay resident
    for layer, lw in enumerate(model.weights.layers):
        for site, names in SITE_LINEARS.items():
            for name in names:
                w = getattr(lw, name).detach().cpu()
                if site in online:
                    w = block_hadamard(w.double(), online[site]).float()
                yield (layer, name), fn(w.numpy(), qmax)
                read.add(getattr(lw, name))
    read.flush()


def plan_from_scales(
    model,
    scales: dict[tuple[int, str], float],
    shadow: dict[tuple[int, str], tuple[int, ...]] | None = None,
    method: str = "manual",
    weight_granularity: str = DEFAULT_WEIGHT_GRANULARITY,
    weight_qmax: int = DEFAULT_WEIGHT_QMAX,
    weight_form: str | None = None,
) -> QuantPlan:
    """A plan from explicit per-site scales (tests, baselines); `shadow` maps sites to their channels.

    weight_form (`quantize.WEIGHT_FORMS`), when given, sets the weights' range instead of weight_qmax."""
    weight_qmax, weight_form = weight_range(weight_qmax, weight_form)
    shadow = shadow or {}
    sites = {k: SiteQuant(float(s), tuple(shadow.get(k, ())), len(shadow.get(k, ()))) for k, s in scales.items()}
    _check_sites(sites, model.config.n_layers)
    return QuantPlan(sites, quantize_weights(model, weight_granularity, weight_qmax), model.fingerprint, method,
                     weight_granularity=weight_granularity, weight_qmax=weight_qmax, weight_form=weight_form)


def weight_range(weight_qmax: int, weight_form: str | None) -> tuple[int, str]:
    """(qmax, form) of a plan: the form's qmax when a form is given, else `form_for_qmax(weight_qmax)`."""
    if weight_form is None:
        return weight_qmax, form_for_qmax(check_weight_qmax(weight_qmax))
    return WEIGHT_FORMS[check_weight_form(weight_form)].qmax, weight_form
