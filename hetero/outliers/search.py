"""Per-site precision search: every activation site runs W8A8 clipped, W8A8 + shadow outliers
(mllm-NPU §3.3, Eq. 1) or W8A16, chosen to meet a perplexity budget at the least predicted time.

Damage is measured on a validation split of the calibration corpus (after the calibrated tokens, disjoint
from the evaluation text): one float forward + backward gives every site's input x and the loss gradient g
there, and an option's damage is ½·Σ g²·(Q(x) − x)², the diagonal-Fisher estimate of the loss it adds
(HAWQ-V2's criterion; it replaces §3.3's absmax/s ratio). Per site the options on the lower convex hull of
(predicted µs, damage) are upgrade steps; steps are taken greedily by damage removed per µs, and the number
taken is the smallest whose measured validation perplexity (the exact INT8 reference) meets the budget.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hetero import model as ref
from hetero.torch_backends import TorchBackend
from hetero.errors import ConfigError
from hetero.model import FloatLinear, observed
from hetero.weights import SITE_LINEARS
from hetero.outliers.a16 import A16_QMAX, A16_QMIN
from hetero.outliers.calibration import USER_FILE, CalibrationStats, SiteStats, calibration_path, token_windows
from hetero.outliers.corpus import DEFAULT_CALIBRATION, corpus_id, load_corpus
from hetero.outliers.plan import QuantPlan
from hetero.outliers.pruning import PlanOptions, SiteChoice, plan_from_choices
from hetero.outliers.quantize import ACT_QMAX, ACT_QMIN, W_QMAX, WEIGHT_FORMS, check_weight_form, fake_quant
from hetero.outliers.rotate import block_hadamard
from hetero.outliers.shadow import QuantizedBackend
from hetero.paths import cached
from hetero.paths import keep as keep_in_cache
from hetero.timing import median_seconds

log = logging.getLogger(__name__)

SEARCH_VERSION = 1
DEFAULT_BUDGET_PCT = 1.0  # validation perplexity at most float's + 1%
VALIDATION_TOKENS = 2048
VALIDATION_WINDOW = 256
# Candidate options of every site: three clipping points for clipped INT8 (same cost, damage decides),
# two shadow thresholds, W8A16.
OPTIONS = (SiteChoice("a8", 99.99), SiteChoice("a8", 99.999), SiteChoice("a8", 100.0),
           SiteChoice("a8s", 99.9), SiteChoice("a8s", 99.5), SiteChoice("a16", 100.0))


@dataclass(frozen=True, slots=True)
class SiteCosts:
    """What an option costs per chunk of `chunk` rows, in predicted µs.

    int8_us_per_mac: the NPU lane's time per INT8 multiply-accumulate (from the host's profile: its
    `qkv` + `o_ffn` time over their MACs). a16_factor: W8A16 over W8A8 (2: two u8 passes on the CPU EP,
    `a16`). float_us_per_mac / extract_us_per_value: the CPU lane's shadow matmul and outlier extraction
    (`shadow.split_outliers`), measured on this host (`measure_shadow_costs`).
    """

    int8_us_per_mac: float
    float_us_per_mac: float
    extract_us_per_value: float
    a16_factor: float = 2.0
    chunk: int = 256

    def option_us(self, choice: SiteChoice, st: SiteStats, n_in: int, n_out: int) -> float:
        base = self.chunk * n_in * n_out * self.int8_us_per_mac
        if choice.kind == "a16":
            return self.a16_factor * base
        if choice.kind == "a8":
            return base
        width = expected_width(st.channel_counts(choice.percentile), st.n_values / max(n_in, 1), self.chunk)
        return base + self.chunk * (n_in * self.extract_us_per_value + width * n_out * self.float_us_per_mac)


def expected_width(counts: np.ndarray, n_tokens: float, chunk: int) -> float:
    """Expected number of channels with an outlier in a chunk of `chunk` tokens (the shadow matmul's width),
    each channel's per-token outlier rate taken from the calibration counts."""
    if n_tokens <= 0:
        return 0.0
    p = np.clip(counts / n_tokens, 0.0, 1.0)
    return float((1.0 - (1.0 - p) ** chunk).sum())


def measure_shadow_costs(n_in: int = 1536, n_out: int = 576, width: int = 64, chunk: int = 256,
                         repeats: int = 7) -> tuple[float, float]:
    """(float µs per MAC of a [chunk, width] × [width, n_out] matmul, µs per value of outlier extraction over
    [chunk, n_in]), medians of `repeats` on this host with torch's current threads."""
    from hetero.outliers.shadow import split_outliers

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(chunk, n_in, generator=gen)
    r, rows = torch.randn(chunk, width, generator=gen), torch.randn(width, n_out, generator=gen)

    matmul, extract = (1e6 * median_seconds(f, repeats) for f in (lambda: r @ rows, lambda: split_outliers(x, 2.5)))
    return matmul / (chunk * width * n_out), extract / (chunk * n_in)


def validation_windows(model, calibration: CalibrationStats, n_tokens: int = VALIDATION_TOKENS,
                       window: int = VALIDATION_WINDOW, corpus: str = DEFAULT_CALIBRATION) -> list[torch.Tensor]:
    """The validation split: `n_tokens` tokens of the calibration corpus right after the calibrated ones."""
    text = load_corpus(corpus)
    if corpus_id(corpus, text) != calibration.corpus:
        raise ConfigError(f"the validation corpus {corpus!r} is not the calibration's ({calibration.corpus})")
    wins = token_windows(model.tokenizer, text, n_tokens, window, offset=calibration.n_tokens)
    if sum(w.numel() for w in wins) < n_tokens // 2:
        raise ConfigError(f"corpus {corpus!r} has too few tokens after the {calibration.n_tokens} calibrated ones "
                          f"for a validation split of {n_tokens}")
    return wins


def perplexity(model, windows: Sequence[torch.Tensor], backend=None) -> float:
    """exp(mean NLL) of every next-token prediction inside the windows (`backend` None: float)."""
    nll, n = 0.0, 0
    for ids in windows:
        lg = ref.forward(model.config, model.weights, ids, backend)[0]
        nll -= float(torch.log_softmax(lg[:-1].double(), -1).gather(1, ids[1:, None]).sum())
        n += ids.numel() - 1
    return math.exp(nll / n)


def _delta(choice: SiteChoice, x: torch.Tensor, st: SiteStats) -> torch.Tensor:
    """Q(x) − x of an option on site input x (in the site's online-transformed domain)."""
    if choice.kind == "a16":
        return fake_quant(x, choice.site_quant(st).scale, A16_QMIN, A16_QMAX) - x
    s = st.scale(choice.percentile)
    d = fake_quant(x, s, ACT_QMIN, ACT_QMAX) - x
    if choice.kind == "a8s":  # values beyond the INT8 range run exactly on the shadow path (Eq. 1)
        d = torch.where((x < ACT_QMIN * s) | (x > ACT_QMAX * s), torch.zeros_like(d), d)
    return d


def site_damage(model, calibration: CalibrationStats, windows: Sequence[torch.Tensor],
                online: Mapping[str, int] | None = None, options: Sequence[SiteChoice] = OPTIONS
                ) -> dict[tuple[int, str], list[float]]:
    """Damage of every option at every site (nats over the windows): ½·Σ g²·(Q(x) − x)², g = ∂NLL/∂x."""
    cfg, w = model.config, model.weights
    online = dict(online or {})
    damage = {k: [0.0] * len(options) for k in calibration.sites}
    for ids in windows:
        xs: dict[tuple[int, str], torch.Tensor] = {}

        def keep(layer: int, site: str, x: torch.Tensor) -> None:
            x.retain_grad()
            xs[(layer, site)] = x

        with torch.enable_grad():
            h0 = ref.embed(w, ids).detach().requires_grad_(True)
            h, _, _ = ref.layer_stack(cfg, w, h0, TorchBackend(cfg, w, observed(FloatLinear(w), keep)))
            loss = F.cross_entropy(ref.logits(cfg, w, h)[:-1], ids[1:], reduction="sum")
            loss.backward()
        with torch.no_grad():
            for (layer, site), x in xs.items():
                x, g = x.detach(), x.grad
                if site in online:
                    x, g = block_hadamard(x, online[site]), block_hadamard(g, online[site])
                g2 = (g.double() ** 2)
                st = calibration.sites[(layer, site)]
                for i, choice in enumerate(options):
                    damage[(layer, site)][i] += 0.5 * float((g2 * _delta(choice, x, st).double() ** 2).sum())
    return damage


@dataclass(frozen=True, slots=True)
class Step:
    key: tuple[int, str]
    to: int  # index into OPTIONS
    efficiency: float  # damage removed per µs added


def hull_steps(costs: Sequence[float], damages: Sequence[float]) -> tuple[int, list[tuple[int, float]]]:
    """(start option, [(next option, efficiency), ...]) along the lower convex hull of (cost, damage): the
    cheapest (least damaging among equals) first, each step with decreasing damage removed per µs."""
    order = sorted(range(len(costs)), key=lambda i: (costs[i], damages[i], i))
    hull = [order[0]]
    for i in order[1:]:
        if damages[i] >= damages[hull[-1]] or costs[i] <= costs[hull[-1]]:
            continue  # dominated: costs more, removes nothing
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (damages[a] - damages[b]) / (costs[b] - costs[a]) <= (damages[b] - damages[i]) / (costs[i] - costs[b]):
                hull.pop()  # b is above the segment a-i
            else:
                break
        hull.append(i)
    steps = [(b, (damages[a] - damages[b]) / (costs[b] - costs[a])) for a, b in zip(hull, hull[1:])]
    return hull[0], steps


@dataclass(frozen=True, slots=True)
class PrecisionPlan:
    """The searched precision of every site, with what it was chosen for and what it measured."""

    choices: dict[tuple[int, str], SiteChoice]
    budget_pct: float
    float_ppl: float  # validation perplexity of the float model
    ppl: float  # validation perplexity of this plan (exact INT8 reference)
    predicted_us: float  # predicted NPU + shadow time of one chunk through every layer
    met: bool  # ppl <= float_ppl·(1 + budget)
    meta: dict

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.choices.values():
            out[c.kind] = out.get(c.kind, 0) + 1
        return out

    def to_dict(self) -> dict:
        return {"version": SEARCH_VERSION, "budget_pct": self.budget_pct, "float_ppl": self.float_ppl, "ppl": self.ppl,
                "predicted_us": self.predicted_us, "met": self.met, "meta": self.meta, "counts": self.counts(),
                "choices": [{"layer": l, "site": s, **asdict(c)} for (l, s), c in sorted(self.choices.items())]}

    @classmethod
    def from_dict(cls, d: dict) -> "PrecisionPlan":
        if d.get("version") != SEARCH_VERSION:
            raise ConfigError(f"precision plan version must be {SEARCH_VERSION}, got {d.get('version')!r}")
        choices = {(int(e["layer"]), str(e["site"])): SiteChoice(str(e["kind"]), float(e["percentile"]))
                   for e in d["choices"]}
        return cls(choices, float(d["budget_pct"]), float(d["float_ppl"]), float(d["ppl"]), float(d["predicted_us"]),
                   bool(d["met"]), dict(d.get("meta", {})))


def search_precision(model, calibration: CalibrationStats, costs: SiteCosts, budget_pct: float = DEFAULT_BUDGET_PCT,
                     weight_form: str | None = None, online: Mapping[str, int] | None = None,
                     windows: Sequence[torch.Tensor] | None = None, progress: bool = False) -> PrecisionPlan:
    """The least predicted-time choice of every site whose validation perplexity is within `budget_pct`
    percent of float's (module doc). When even the most accurate hull point misses the budget, that
    point is returned with `met` False."""
    if not budget_pct > 0:
        raise ConfigError(f"budget must be a perplexity increase in percent > 0, got {budget_pct!r}")
    # progress on stderr, as calibration's: stdout is the command's answer (`hetero run --json`)
    say = (lambda m: print(f"hetero: {m}", file=sys.stderr, flush=True)) if progress else log.info
    t0 = time.perf_counter()
    online = dict(online or {})
    windows = list(windows) if windows is not None else validation_windows(model, calibration)
    dims = {"attn_in": model.config.hidden, "o_in": model.config.q_dim, "ffn_in": model.config.hidden,
            "down_in": model.config.ffn}
    lw0 = model.weights.layers[0]
    outs = {site: sum(getattr(lw0, n).shape[0] for n in names) for site, names in SITE_LINEARS.items()}
    say(f"precision search: site damage on {sum(w.numel() for w in windows)} validation tokens")
    damage = site_damage(model, calibration, windows, online)
    start: dict[tuple[int, str], int] = {}
    steps: list[Step] = []
    cost_of: dict[tuple[int, str], list[float]] = {}
    for key, st in sorted(calibration.sites.items()):
        c = [costs.option_us(o, st, dims[key[1]], outs[key[1]]) for o in OPTIONS]
        cost_of[key] = c
        first, hull = hull_steps(c, damage[key])
        start[key] = first
        steps += [Step(key, to, eff) for to, eff in hull]
    steps.sort(key=lambda s: -s.efficiency)  # stable: a site's own steps keep their (decreasing) order

    def choices_at(k: int) -> dict[tuple[int, str], int]:
        idx = dict(start)
        for s in steps[:k]:
            idx[s.key] = s.to
        return idx

    base = plan_from_choices(model, calibration, {k: OPTIONS[i] for k, i in start.items()},
                             PlanOptions(method="w8a8-choices", prune_fraction=0.0, weight_form=weight_form, online=online))
    float_ppl = perplexity(model, windows)
    target = float_ppl * (1 + budget_pct / 100)
    measured: dict[int, float] = {}

    def ppl_at(k: int) -> float:
        if k not in measured:
            idx = choices_at(k)
            plan = replace(base, sites={key: OPTIONS[i].site_quant(calibration.sites[key]) for key, i in idx.items()})
            measured[k] = perplexity(model, windows, QuantizedBackend(model.config, model.weights, plan))
            say(f"precision search: {k}/{len(steps)} upgrades, validation ppl {measured[k]:.4f} "
                f"(float {float_ppl:.4f}, target {target:.4f})")
        return measured[k]

    # first probe where the damage estimate meets the budget, then bisect on measured perplexity
    idx, total = dict(start), sum(damage[k][i] for k, i in start.items())
    allowed = sum(w.numel() - 1 for w in windows) * math.log1p(budget_pct / 100)
    guess = len(steps)
    for k, s in enumerate(steps):
        if total <= allowed:
            guess = k
            break
        total -= damage[s.key][idx[s.key]] - damage[s.key][s.to]
        idx[s.key] = s.to
    lo, hi = -1, len(steps)  # ppl_at(lo) > target (-1: assumed), ppl_at(hi) <= target unless hi is the end
    if ppl_at(guess) <= target:
        hi = guess
    else:
        lo = guess
    if ppl_at(hi) <= target:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ppl_at(mid) <= target:
                hi = mid
            else:
                lo = mid
    idx = choices_at(hi)
    ppl = ppl_at(hi)
    predicted = sum(cost_of[k][i] for k, i in idx.items())
    meta = {"validation_tokens": sum(w.numel() for w in windows), "validation_corpus": calibration.corpus,
            "validation_offset": calibration.n_tokens, "weight_form": base.weight_form, "online": online,
            "costs": asdict(costs), "upgrades": hi, "candidate_upgrades": len(steps),
            "measured": {str(k): v for k, v in sorted(measured.items())},
            "seconds": round(time.perf_counter() - t0, 1)}
    plan = PrecisionPlan({k: OPTIONS[i] for k, i in idx.items()}, budget_pct, float_ppl, ppl, predicted,
                         ppl <= target, meta)
    say(f"precision search: {plan.counts()} at validation ppl {ppl:.4f} ({100 * (ppl / float_ppl - 1):+.2f}% vs "
        f"float, budget {budget_pct:+.2f}%), predicted {predicted / 1e3:.1f} ms per chunk, {meta['seconds']} s")
    return plan


def precision_path(model, weight_form: str) -> Path:
    """Cache entry of the model's chosen precision plan, beside the calibration in use (the user's has its own,
    `calibration.calibration_path`). One per weight range: the 8-bit forms (u8·s8, u8·u8) hold the same weights
    (`quantize.WEIGHT_FORMS`), so they share a plan."""
    bits = 8 if WEIGHT_FORMS[check_weight_form(weight_form)].qmax == W_QMAX else 7
    calibration = calibration_path(model)
    user = "user-" if calibration.name == USER_FILE else ""
    return calibration.parent / f"precision-{user}w{bits}-v{SEARCH_VERSION}.json"


def load_precision(path: Path) -> PrecisionPlan:
    try:
        return PrecisionPlan.from_dict(json.loads(Path(path).read_text()))
    except ConfigError:
        raise
    except Exception as e:  # truncated, edited: searched again, never trusted
        raise ConfigError(f"precision plan {path} is unreadable: {type(e).__name__}: {e}") from e


def ensure_precision(model, calibration: CalibrationStats, costs: Callable[[], SiteCosts], weight_form: str,
                     online: Mapping[str, int] | None = None, budget_pct: float | None = None,
                     progress: bool = False) -> PrecisionPlan:
    """The model's chosen precision plan: the cached one (whatever budget it was searched for) unless
    `budget_pct` asks for a new search; with none cached, a search at `DEFAULT_BUDGET_PCT`, then cached
    (`hetero calibrate --budget` runs a new one). `costs` is called only when a search runs. A cache entry
    (`paths.cached`): checked against its content record, searched again with a warning when damaged or
    searched for another calibration; an unwritable cache searches for this run only."""
    path = precision_path(model, weight_form)

    def load(p: Path) -> PrecisionPlan:
        plan = load_precision(p)
        if not (set(plan.choices) == set(calibration.sites) and plan.meta.get("validation_corpus") == calibration.corpus
                and plan.meta.get("validation_offset") == calibration.n_tokens):
            raise ConfigError(f"precision plan {p} was searched for another calibration")
        return plan

    def search(budget: float) -> PrecisionPlan:
        return search_precision(model, calibration, costs(), budget, weight_form, online, progress=progress)

    def save(plan: PrecisionPlan, tmp: Path) -> None:
        tmp.write_text(json.dumps(plan.to_dict(), indent=1))

    if budget_pct is None:
        return cached(path.parent, path.name, load, lambda: search(DEFAULT_BUDGET_PCT), save, "precision plan")
    plan = search(budget_pct)
    keep_in_cache(path.parent, path.name, plan, save)
    return plan


def plan_of(model, calibration: CalibrationStats, precision: PrecisionPlan, weight_form: str | None = None,
            online: Mapping[str, int] | None = None) -> QuantPlan:
    """The `QuantPlan` a searched precision runs."""
    meta = {"budget_pct": precision.budget_pct, "validation_ppl": precision.ppl, "float_validation_ppl": precision.float_ppl,
            "predicted_us": precision.predicted_us, "met": precision.met}
    return plan_from_choices(model, calibration, precision.choices,
                             PlanOptions(method="w8a8-searched", prune_fraction=0.0, weight_form=weight_form,
                                         online=online), meta)
