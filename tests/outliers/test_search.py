"""Per-site precision search (hetero/outliers/search.py) on the tiny outlier model."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from hetero.errors import ConfigError
from hetero.outliers.calibration import calibrate
from hetero.outliers.pruning import SiteChoice
from hetero.outliers.search import (
    OPTIONS,
    PrecisionPlan,
    SiteCosts,
    ensure_precision,
    expected_width,
    hull_steps,
    perplexity,
    plan_of,
    precision_path,
    search_precision,
    site_damage,
)
from hetero.outliers.shadow import QuantizedBackend
from tests.outliers.test_calibrate import TEXT, ByteTokenizer

COSTS = SiteCosts(int8_us_per_mac=1e-6, float_us_per_mac=4e-5, extract_us_per_value=1e-3, chunk=64)


@pytest.fixture(scope="module")
def setup(tiny):
    model = dataclasses.replace(tiny, tokenizer=ByteTokenizer())
    stats = calibrate(model, TEXT, n_tokens=256, window=64, corpus="fox", progress=False)
    # the validation split: the text after the calibrated tokens (the same sentence: no value beyond the calibration's)
    windows = list(torch.tensor(list(TEXT.encode())[256:448]).split(64))
    return model, stats, windows


def test_hull_drops_dominated_options_and_orders_steps_by_falling_efficiency():
    #            a8    a8'   a8s   a8s'  a16   (cost, damage)
    costs = [1.0, 1.0, 1.5, 3.0, 2.0]
    damages = [9.0, 5.0, 6.0, 0.5, 1.0]
    first, steps = hull_steps(costs, damages)
    assert first == 1  # cheapest, least damaging of the equally cheap
    assert [to for to, _ in steps] == [4, 3]  # 1.5 costs more yet damages more than option 1: dominated
    effs = [e for _, e in steps]
    assert effs == sorted(effs, reverse=True) and all(e > 0 for e in effs)


def test_expected_width_counts_channels_likely_to_have_an_outlier():
    import numpy as np

    counts = np.array([0, 1000, 1, 0])
    w = expected_width(counts, 1000.0, 256)
    assert w == pytest.approx(1 + (1 - (1 - 1e-3) ** 256))


def test_damage_orders_options_as_their_quantization_error(setup):
    model, stats, windows = setup
    damage = site_damage(model, stats, windows)
    idx = {(c.kind, c.percentile): i for i, c in enumerate(OPTIONS)}
    for key, d in damage.items():
        assert all(v >= 0 for v in d)
        assert d[idx[("a16", 100.0)]] <= d[idx[("a8", 100.0)]]  # 256x finer grid over the same range
        assert d[idx[("a8s", 99.9)]] <= d[idx[("a8", 99.999)]] or d[idx[("a8", 99.999)]] == 0


def test_damage_runs_on_weights_first_used_in_inference_mode(setup):
    """A cached model's weights are mapped at their first use, which is calibration's, inside inference mode;
    the search's backward pass must still run through them (`hetero calibrate --budget` crashed with
    "Inference tensors cannot be saved for backward")."""
    from hetero.loader import weights_of
    from hetero.weights import weight_arrays

    model, stats, windows = setup
    arrays = {k: v.copy() for k, v in weight_arrays(model.weights).items()}
    lazy = model.with_weights(lambda: weights_of(model.config, arrays), lambda: arrays)
    calibrate(lazy, TEXT, n_tokens=128, window=64, corpus="fox", progress=False)  # first use: in inference mode
    assert not lazy.weights.tok_emb.is_inference()
    assert site_damage(lazy, stats, windows[:1]) == site_damage(model, stats, windows[:1])


def test_search_meets_the_budget_with_the_measured_perplexity(setup):
    model, stats, windows = setup
    fp = perplexity(model, windows)
    tight, loose = (search_precision(model, stats, COSTS, b, "w8-u8s8", windows=windows) for b in (0.05, 50.0))
    for p in (tight, loose):
        assert p.float_ppl == pytest.approx(fp)
        assert p.met == (p.ppl <= fp * (1 + p.budget_pct / 100))
        # the plan it returns is the one it measured
        plan = plan_of(model, stats, p, "w8-u8s8")
        assert perplexity(model, windows, QuantizedBackend(model.config, model.weights, plan)) == pytest.approx(p.ppl)
    assert loose.met
    assert loose.predicted_us <= tight.predicted_us  # a looser budget never costs more
    assert tight.meta["upgrades"] >= loose.meta["upgrades"]


def test_cached_plan_round_trips_and_is_replaced_by_a_new_budget(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    model, stats, windows = setup
    calls = []

    def costs():
        calls.append(1)
        return COSTS

    monkeypatch.setattr("hetero.outliers.search.validation_windows", lambda *a, **k: windows)
    first = ensure_precision(model, stats, costs, "w8-u8s8")
    again = ensure_precision(model, stats, costs, "w8-u8u8")  # same 8-bit weights: same cached plan
    assert len(calls) == 1 and again == first
    assert precision_path(model, "w8-u8s8") == precision_path(model, "w8-u8u8") != precision_path(model, "w7-u8s8")
    other = ensure_precision(model, stats, costs, "w8-u8s8", budget_pct=25.0)
    assert len(calls) == 2 and other.budget_pct == 25.0
    assert ensure_precision(model, stats, costs, "w8-u8s8").budget_pct == 25.0  # the new plan is the cached one
    path = precision_path(model, "w8-u8s8")
    assert json.loads(path.read_text())["budget_pct"] == 25.0
    path.write_text("{ truncated")
    ensure_precision(model, stats, costs, "w8-u8s8")  # unreadable: searched again, not trusted
    assert len(calls) == 3 and PrecisionPlan.from_dict(json.loads(path.read_text())).budget_pct == 1.0
    st, text = path.stat(), path.read_text()  # an edit that keeps size and mtime ...
    path.write_text(text.replace('"budget_pct": 1.0', '"budget_pct": 7.0'))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert ensure_precision(model, stats, costs, "w8-u8s8").budget_pct == 1.0  # ... fails its content hash
    assert len(calls) == 4


def test_bad_input_is_named(setup):
    model, stats, windows = setup
    with pytest.raises(ConfigError, match="budget"):
        search_precision(model, stats, COSTS, 0.0, windows=windows)
    with pytest.raises(ConfigError, match="precision"):
        SiteChoice("a4", 99.9)
    with pytest.raises(ConfigError, match="percentile"):
        SiteChoice("a8", 97.0)
