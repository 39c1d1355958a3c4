"""The plan derived from a calibration is kept beside it and read back equal, checked, and named by everything it
depends on (`outliers.plancache`, issue 28)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from hetero.outliers import plancache
from hetero.outliers.calibration import calibration_path, ensure_calibration
from hetero.outliers.pruning import PlanOptions, plan_from_calibration
from tests.outliers.test_calibrate import TEXT, ByteTokenizer


@pytest.fixture
def calibrated(tiny, tmp_path, monkeypatch):
    """A tiny model with its calibration in an empty cache (the entry a loaded model has)."""
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    model = dataclasses.replace(tiny, tokenizer=ByteTokenizer())
    corpus = tmp_path / "fox.txt"
    corpus.write_text(TEXT)
    calib = ensure_calibration(model, calibration_path(model), corpus=str(corpus), n_tokens=256, window=64)
    return model, calib


def _equal(a, b) -> bool:
    return (a.to_dict() == b.to_dict() and list(a.sites) == list(b.sites) and a.weights.keys() == b.weights.keys()
            and all(np.array_equal(a.weights[k].q, b.weights[k].q) for k in a.weights))


def test_a_plan_is_derived_once_then_read_back_equal(calibrated, monkeypatch):
    model, calib = calibrated
    options = PlanOptions(prune_fraction=0.5, a16=[(1, "down_in")])
    first = plancache.cached_plan(model, options)
    assert len(list(calibration_path(model).parent.glob("plan-*.json"))) == 1
    assert _equal(first, plan_from_calibration(model, calib, options))
    monkeypatch.setattr(plancache, "plan_from_calibration", lambda *a, **k: pytest.fail("derived again"))
    monkeypatch.setattr(plancache, "ensure_calibration", lambda *a, **k: pytest.fail("calibration loaded"))
    assert _equal(plancache.cached_plan(model, options), first)


def test_other_options_or_code_name_another_plan(calibrated, monkeypatch):
    model, _ = calibrated
    plancache.cached_plan(model, PlanOptions())
    plancache.cached_plan(model, PlanOptions(prune_fraction=1.0))
    monkeypatch.setattr(plancache, "_code_digest", lambda: "an edited pruning.py")
    plancache.cached_plan(model, PlanOptions())
    assert len(list(calibration_path(model).parent.glob("plan-*.json"))) == 3


def test_a_damaged_plan_is_derived_again_with_a_warning(calibrated, caplog):
    model, calib = calibrated
    plancache.cached_plan(model, PlanOptions())
    (path,) = calibration_path(model).parent.glob("plan-*.json")
    path.write_text(path.read_text().replace('"layer": 1', '"layer": 0', 1))  # same size, other content
    with caplog.at_level(logging.WARNING):
        again = plancache.cached_plan(model, PlanOptions())
    assert "fails its content hash" in caplog.text
    assert _equal(again, plan_from_calibration(model, calib, PlanOptions()))
