"""A user's calibration (`hetero calibrate`) is kept beside the shipped one, never over it, and runs only when asked
to (HETERO_CALIBRATION=user); `hetero info` says which is in use."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import numpy as np
import pytest

from hetero import shipped as package_data
from hetero.cli import main
from hetero.errors import ConfigError
from hetero.outliers import calibration as cal
from hetero.outliers.calibration import (DEFAULT_TOKENS, DEFAULT_WINDOW, calibrate, calibration_in_use, calibration_path,
                                         ensure_calibration)
from hetero.outliers.corpus import DEFAULT_CALIBRATION
from hetero.paths import content_hash, keep
from tests.outliers.test_calibrate import TEXT, ByteTokenizer


@pytest.fixture
def shipped(tiny, tmp_path, monkeypatch):
    """A tiny model whose calibration (256 tokens of TEXT) ships with the package for the default settings, and an
    empty cache."""
    model = dataclasses.replace(tiny, tokenizer=ByteTokenizer())
    stats = calibrate(model, TEXT, n_tokens=256, window=64, corpus="fox", progress=False)
    ship = tmp_path / "data" / "calibration"
    ship.mkdir(parents=True)
    stats.save(ship / "tiny.npz")
    (ship / "manifest.json").write_text(json.dumps({model.fingerprint: {
        "file": "tiny.npz", "xxh3": content_hash(ship / "tiny.npz"), "corpus": DEFAULT_CALIBRATION,
        "n_tokens": DEFAULT_TOKENS, "window": DEFAULT_WINDOW}}))
    monkeypatch.setattr(package_data, "DATA", tmp_path / "data")
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HETERO_CALIBRATION", raising=False)
    return model, ship / "tiny.npz"


def _hetero_calibrate(model, monkeypatch, tmp_path, *args: str) -> int:
    """`hetero calibrate` on the tiny model (its loader and rotation stubbed), 128 tokens of TEXT."""
    monkeypatch.setattr("hetero.loader.load_model", lambda path=None: model)
    monkeypatch.setattr("hetero.methods.quant_model", lambda m, recipe: m)
    corpus = tmp_path / "fox.txt"
    corpus.write_text(TEXT)
    return main(["calibrate", "--corpus", str(corpus), "--tokens", "128", "--window", "64", *args])


def test_hetero_calibrate_keeps_the_shipped_calibration_and_runs_it(shipped, tmp_path, monkeypatch, capsys):
    model, package = shipped
    ensure_calibration(model)  # the default slot, seeded from the package byte for byte
    default = calibration_path(model, user=False)
    assert default.read_bytes() == package.read_bytes()
    assert _hetero_calibrate(model, monkeypatch, tmp_path) == 0
    out = capsys.readouterr().out
    user = calibration_path(model, user=True)
    assert str(user) in out and "HETERO_CALIBRATION=user runs this one" in out
    assert default.read_bytes() == package.read_bytes()  # never over the shipped one
    assert ensure_calibration(model).n_tokens == 256  # the default runs the shipped one
    assert "shipped with the package" in calibration_in_use(model)["in use"]
    assert str(user) in calibration_in_use(model)["user"]

    monkeypatch.setenv("HETERO_CALIBRATION", "user")  # opted in: the user's
    assert calibration_path(model) == user and ensure_calibration(model).n_tokens == 128
    assert "the user's" in calibration_in_use(model)["in use"] and "unset it" in calibration_in_use(model)["in use"]


def test_the_user_calibration_is_asked_for_clearly(shipped, monkeypatch):
    model, _ = shipped
    monkeypatch.setenv("HETERO_CALIBRATION", "user")
    with pytest.raises(ConfigError, match="no usable user calibration .* run `hetero calibrate`"):
        ensure_calibration(model)  # none made: never computed behind the user's back
    assert not calibration_path(model, user=True).exists()
    monkeypatch.setenv("HETERO_CALIBRATION", "mine")
    with pytest.raises(ConfigError, match="HETERO_CALIBRATION must be 'user' .* got 'mine'"):
        ensure_calibration(model)


def test_a_calibration_written_over_the_shipped_one_moves_to_the_user_slot(shipped, caplog):
    """A cache where an older `hetero calibrate` replaced the shipped calibration runs the shipped one again."""
    model, package = shipped
    default, user = calibration_path(model, user=False), calibration_path(model, user=True)
    older = calibrate(model, TEXT, n_tokens=128, window=64, corpus="fox", progress=False)
    keep(default.parent, default.name, older, lambda s, tmp: tmp.write_bytes(s.to_bytes()))
    with caplog.at_level(logging.WARNING):
        assert ensure_calibration(model).n_tokens == 256
    assert "kept as the user calibration" in caplog.text
    assert default.read_bytes() == package.read_bytes()
    got = cal.CalibrationStats.load(user, model)
    assert got.n_tokens == 128 and np.array_equal(got.sites[(0, "attn_in")].channel_absmax,
                                                  older.sites[(0, "attn_in")].channel_absmax)


def test_budget_searches_on_the_calibration_in_use_without_calibrating(shipped, tmp_path, monkeypatch, capsys):
    """`hetero calibrate --budget` (it once crashed in the search) exits 0 and writes the searched plan beside
    the calibration in use, calibrating nothing."""
    import torch

    from hetero.outliers.search import precision_path
    from tests.outliers.test_search import COSTS

    model, package = shipped
    model = dataclasses.replace(model, rotated=True)  # what the searched method quantizes (rotation stubbed)
    monkeypatch.setattr("hetero.methods.site_costs", lambda m: COSTS)
    windows = list(torch.tensor(list(TEXT.encode())[256:448]).split(64))
    monkeypatch.setattr("hetero.outliers.search.validation_windows", lambda *a, **k: windows)
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: pytest.fail("--budget calibrated"))
    monkeypatch.setattr("hetero.loader.load_model", lambda path=None: model)
    monkeypatch.setattr("hetero.methods.quant_model", lambda m, recipe: m)
    assert main(["calibrate", "--budget", "50", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precision"]["budget_pct"] == 50 and "shipped" in out["calibration_in_use"]
    assert precision_path(model, "w8-u8s8").is_file()
    assert not calibration_path(model, user=True).exists()
    assert calibration_path(model, user=False).read_bytes() == package.read_bytes()
    assert main(["calibrate", "--budget", "0.5", "--tokens", "128"]) == 2  # one line: nothing to calibrate
    assert "--budget searches" in capsys.readouterr().err
