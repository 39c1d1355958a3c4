"""The plan derived from a calibration is kept beside it and read back equal, checked, and named by everything it
depends on (`outliers.plancache`)."""

from __future__ import annotations

import dataclasses
import json
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


@pytest.fixture
def shipped_plan(calibrated, tmp_path, monkeypatch):
    """`calibrated`'s plan of `PlanOptions()` laid out as the package ships one (`hetero.shipped`), in an empty cache."""
    from hetero import shipped

    model, calib = calibrated
    options = PlanOptions(prune_fraction=0.5)
    path = plancache.plan_file(model, options)
    plancache.keep(path.parent, path.name, plan_from_calibration(model, calib, options).to_dict(), plancache._save)
    monkeypatch.setattr(shipped, "DATA", tmp_path / "data")
    shipped.ship("plans", path.name, path, keep=set())
    path.unlink()
    return model, calib, options, shipped.DATA / "plans" / path.name


def test_a_shipped_plan_is_read_instead_of_derived_and_kept(shipped_plan, monkeypatch):
    model, calib, options, _ = shipped_plan
    monkeypatch.setattr(plancache, "plan_from_calibration", lambda *a, **k: pytest.fail("derived although one ships"))
    got = plancache.cached_plan(model, options)
    assert _equal(got, plan_from_calibration(model, calib, options))
    assert plancache.plan_file(model, options).is_file()  # kept in the cache like a derived one


def test_a_damaged_shipped_plan_is_derived_instead(shipped_plan, caplog):
    model, calib, options, path = shipped_plan
    path.write_text(path.read_text().replace('"layer": 1', '"layer": 0', 1))
    with caplog.at_level(logging.WARNING):
        got = plancache.cached_plan(model, options)
    assert "fails its content hash" in caplog.text
    assert _equal(got, plan_from_calibration(model, calib, options))


@pytest.mark.slow
def test_the_default_plans_ship_and_are_current(default_model):
    """The package holds the default method's plan of the default model for each weight form it runs, under the
    name the current code gives it, equal to a derived one. Fails after an edit to the code a plan is derived with
    (`plancache._code_digest`) until `make ship` writes them again."""
    from hetero import shipped
    from hetero.methods import DEFAULT_RECIPE, SHIPPED_FORMS, plan_options, quant_model
    from hetero.outliers.plan import QuantPlan

    model = quant_model(default_model, DEFAULT_RECIPE)
    calib = ensure_calibration(model, online=plan_options(model, DEFAULT_RECIPE, SHIPPED_FORMS[0]).online)
    names = shipped.manifest("plans")
    for form in SHIPPED_FORMS:
        options = plan_options(model, DEFAULT_RECIPE, form)
        name = plancache.plan_file(model, options).name
        assert name in names, f"no shipped plan {name} for {form}: run `make ship`"
        path = shipped.verified("plans", names[name])
        assert path is not None
        got = plancache._in_site_order(QuantPlan.from_dict(json.loads(path.read_text()), model))
        assert _equal(got, plan_from_calibration(model, calib, options))
    assert len(names) == len(set(SHIPPED_FORMS)), "stale shipped plans: run `make ship`"
