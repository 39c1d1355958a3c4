"""Importance ranking, pruning selection, hot channels, plan_from_calibration (hetero/outliers/pruning.py)."""

from __future__ import annotations

import numpy as np
import pytest

from hetero.errors import ConfigError
from hetero.outliers.calibration import PERCENTILES, CalibrationStats, SiteStats, site_dims
from hetero.weights import SITES
from hetero.outliers.pruning import PlanOptions, hot_channels, kept_sites, plan_from_calibration, rank_sites


def fake_stats(model, importance):
    dims = site_dims(model.config)
    sites = {}
    for (l, s), imp in importance.items():
        counts = np.zeros((len(PERCENTILES), dims[s]), dtype=np.int64)
        counts[:, :3] = [[50, 30, 20]] * len(PERCENTILES)
        counts[-1] = 0
        t = 1.0  # every percentile threshold at 1.0, absmax sets the importance
        n = len(PERCENTILES)
        sites[(l, s)] = SiteStats(imp * t / 127, 0.1, (t,) * (n - 1) + (imp * t / 127,), (t,) * n, (-t,) * n,
                                  np.ones(dims[s], np.float32), counts)
    return CalibrationStats(model.fingerprint, model.name, model.config.n_layers, dims, "fake", 100, 50, sites)


@pytest.fixture
def stats(tiny):
    imp = {(l, s): 1000.0 + 100 * l + i for l in range(2) for i, s in enumerate(SITES)}
    imp[(0, "down_in")] = 9000.0
    return fake_stats(tiny, imp)


def test_rank_and_keep(stats):
    order = rank_sites(stats, 99.99)
    assert order[0] == (0, "down_in") and order[1] == (1, "down_in")
    assert kept_sites(stats, 0.75) == {(0, "down_in"), (1, "down_in")}  # round(0.25 · 8) = 2
    assert kept_sites(stats, 1.0) == set() and len(kept_sites(stats, 0.0)) == 8
    by_layer = kept_sites(stats, 0.5, granularity="layer")
    assert by_layer == {(0, s) for s in SITES}  # layer 0 holds the top site
    with pytest.raises(ConfigError, match="prune_fraction"):
        kept_sites(stats, 1.5)


def test_hot_channels_cover_80_percent():
    counts = np.array([0, 5, 60, 0, 20, 15])
    ch, n_hot = hot_channels(counts, 0.8)
    assert ch == (2, 4, 5, 1) and n_hot == 2  # 60 + 20 = 80 of 100
    assert hot_channels(np.zeros(4, int)) == ((), 0)


def test_plan_from_calibration(tiny, stats):
    plan = plan_from_calibration(tiny, stats, PlanOptions(prune_fraction=0.75))
    assert plan.shadow_sites() == [(0, "down_in"), (1, "down_in")]
    sq = plan.sites[(0, "down_in")]
    assert sq.shadow_channels == (0, 1, 2) and sq.n_hot == 2 and sq.scale == pytest.approx(1 / 127)
    assert not plan.sites[(0, "attn_in")].shadow
    assert set(plan.weights) == {(l, n) for l in range(2) for n in
                                 ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}


def test_row_scales_take_the_kept_sites_instead_of_shadows(tiny, stats):
    plan = plan_from_calibration(tiny, stats, PlanOptions(prune_fraction=0.75, row_scales=("down_in",)))
    assert plan.shadow_sites() == [] and {k for k, sq in plan.sites.items() if sq.per_row} == {(0, "down_in"), (1, "down_in")}
    assert plan.sites[(0, "down_in")].scale == pytest.approx(1 / 127)  # the calibrated scale, for the record
    kept = plan_from_calibration(tiny, stats, PlanOptions(prune_fraction=0.75, row_scales=("o_in",)))
    assert kept.shadow_sites() == [(0, "down_in"), (1, "down_in")]  # only the named sites
    with pytest.raises(ConfigError, match="row_scales"):
        plan_from_calibration(tiny, stats, PlanOptions(row_scales=("down",)))


def test_a8r_sites_scale_rows_whether_kept_or_not(tiny, stats):
    every = [(layer, site) for layer in range(2) for site in ("attn_in", "down_in")]
    plan = plan_from_calibration(tiny, stats, PlanOptions(prune_fraction=0.75, a8r=every))
    assert {k for k, sq in plan.sites.items() if sq.per_row} == set(every)
    assert plan.shadow_sites() == [] and all(plan.sites[k].bits == 8 for k in every)
    with pytest.raises(ConfigError, match="either W8A16 or a scale per row"):
        plan_from_calibration(tiny, stats, PlanOptions(a16=every[:1], a8r=every))



def test_error_importance_from_histogram(tiny, stats):
    # "error" importance: the relative squared error that pruning adds, from the |x| histogram; a site
    # with a heavier tail beyond the pruned threshold ranks first
    from dataclasses import replace

    from hetero.outliers.calibration import _BINS_PER_OCTAVE, _LOG2_LO, _NBINS

    def hist(tail):
        h = np.zeros(_NBINS)
        h[int((0 - _LOG2_LO) * _BINS_PER_OCTAVE)] = 1000  # |x| ≈ 1
        h[int((6 - _LOG2_LO) * _BINS_PER_OCTAVE)] = tail  # |x| ≈ 64, beyond every threshold (1.0)
        return h

    sites = {k: replace(st, hist_abs=hist(1 + (k == (1, "ffn_in")) * 9), n_values=1001) for k, st in stats.sites.items()}
    st2 = replace(stats, sites=sites)
    order = rank_sites(st2, 99.9, importance="error")
    assert order[0] == (1, "ffn_in") and sorted(order) == sorted(st2.sites)
    assert rank_sites(st2, 99.9)[0] == (0, "down_in")  # the paper's ratio ranking is unchanged
    with pytest.raises(ConfigError, match="importance"):
        rank_sites(st2, 99.9, importance="bogus")
