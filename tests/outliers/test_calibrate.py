"""Calibration statistics, file round trip and validation (hetero/outliers/calibration.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hetero.errors import ConfigError, ModelFormatError
from hetero.outliers.calibration import PERCENTILES, CalibrationStats, calibrate, run_sites
from hetero.weights import SITES


class ByteTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}


TEXT = "The quick brown fox jumps over the lazy dog. " * 20


@pytest.fixture(scope="module")
def stats(tiny):
    model = dataclasses.replace(tiny, tokenizer=ByteTokenizer())
    return calibrate(model, TEXT, n_tokens=256, window=64, corpus="fox", progress=False)


def test_statistics_are_consistent(tiny, stats):
    ids = __import__("torch").tensor(list(TEXT.encode())[:64])
    seen = {}
    run_sites(tiny.config, tiny.weights, ids, lambda l, s, x: seen.setdefault((l, s), float(x.abs().max())))
    assert set(stats.sites) == {(l, s) for l in range(2) for s in SITES}
    for key, st in stats.sites.items():
        assert st.absmax >= seen[key] - 1e-6  # the first window is part of the calibration
        assert st.absmax == pytest.approx(float(st.channel_absmax.max()))
        assert 0 < st.median_abs < st.pct_abs[0] <= st.pct_abs[1] <= st.pct_abs[2] <= st.absmax * 1.02
        assert st.pct_neg[-1] <= 0 <= st.pct_pos[-1]
        # counts fall as the threshold grows; nothing exceeds absmax
        assert np.all(np.diff(st.counts.sum(1)) <= 0) and st.counts[-1].sum() == 0
        assert st.importance(99.99) == pytest.approx(st.absmax / st.scale(99.99))
    # the planted outlier channel 3 of attn_in (norm weight 12) dominates the counts
    assert int(np.argmax(stats.sites[(0, "attn_in")].channel_counts(99.9))) in (3, 17)
    assert stats.n_tokens == 256


def test_file_round_trip_and_validation(tiny, make_tiny, stats, tmp_path):
    path = stats.save(tmp_path / "calib.npz")
    assert not list(tmp_path.glob(".*tmp"))  # atomic: no temporary left behind
    back = CalibrationStats.load(path, tiny)
    for key, st in stats.sites.items():
        b = back.sites[key]
        assert b.absmax == st.absmax and b.pct_abs == st.pct_abs
        assert np.array_equal(b.counts, st.counts) and np.array_equal(b.channel_absmax, st.channel_absmax)
    with pytest.raises(ConfigError, match="calibration is for model"):
        CalibrationStats.load(path, make_tiny(fingerprint="0123456789abcdef"))
    with pytest.raises(ConfigError, match="does not exist"):
        CalibrationStats.load(tmp_path / "none.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ModelFormatError, match="corrupt"):
        CalibrationStats.load(tmp_path / "bad.npz")
    with pytest.raises(ConfigError, match="percentile"):
        stats.sites[(0, "o_in")].scale(42.0)
    assert len(PERCENTILES) == stats.sites[(0, "o_in")].counts.shape[0]


def test_atomic_save_leaves_old_file_on_failure(stats, tmp_path, monkeypatch):
    path = stats.save(tmp_path / "calib.npz")
    before = path.read_bytes()
    import hetero.outliers.calibration as cal

    monkeypatch.setattr(cal.np, "savez_compressed", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        stats.save(path)
    assert path.read_bytes() == before


def test_one_layer_at_a_time_equals_the_whole_model_over_each_window(tiny, stats):
    """Calibration runs a layer over every window, then the next: its per-channel maxima and counts are exactly those
    of the site inputs the whole model gives each window (`run_sites`), with the thresholds it chose."""
    import torch

    from hetero.outliers.calibration import token_windows

    chmax: dict = {}
    counts: dict = {}

    def observe(layer, site, x):
        k = (layer, site)
        chmax[k] = torch.maximum(chmax.get(k, torch.zeros(x.shape[1])), x.abs().amax(0))
        thr = torch.tensor(stats.sites[k].pct_abs, dtype=torch.float32)
        counts[k] = counts.get(k, 0) + (x.abs().unsqueeze(0) > thr.view(-1, 1, 1)).sum(1)

    with torch.inference_mode():
        for ids in token_windows(ByteTokenizer(), TEXT, 256, 64):
            run_sites(tiny.config, tiny.weights, ids, observe)
    for key, st in stats.sites.items():
        assert np.array_equal(st.channel_absmax, chmax[key].numpy()), key
        assert np.array_equal(st.counts, counts[key].numpy()), key
