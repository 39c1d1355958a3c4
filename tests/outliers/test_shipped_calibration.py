"""A model whose calibration ships with the package starts without calibrating, and only from a file
that passes its content hash."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import numpy as np
import pytest

from hetero import shipped as package_data
from hetero.outliers import calibration as cal
from hetero.outliers.calibration import ensure_calibration
from hetero.paths import content_hash
from tests.outliers.test_calibrate import TEXT, ByteTokenizer


@pytest.fixture
def shipped(tiny, tmp_path, monkeypatch):
    """A tiny model's calibration laid out as the package ships one, with its manifest."""
    model = dataclasses.replace(tiny, tokenizer=ByteTokenizer())
    corpus = tmp_path / "fox.txt"
    corpus.write_text(TEXT)
    made = ensure_calibration(model, tmp_path / "made.npz", corpus=str(corpus), n_tokens=256, window=64)
    ship = tmp_path / "data" / "calibration"
    ship.mkdir(parents=True)
    shutil.copyfile(tmp_path / "made.npz", ship / "tiny.npz")
    manifest = {model.fingerprint: {"file": "tiny.npz", "xxh3": content_hash(ship / "tiny.npz"),
                                    "corpus": str(corpus), "n_tokens": 256, "window": 64}}
    (ship / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(package_data, "DATA", tmp_path / "data")
    return model, str(corpus), made, ship


def test_a_shipped_calibration_is_used_and_cached_instead_of_calibrating(shipped, tmp_path, monkeypatch):
    model, corpus, made, _ = shipped
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: pytest.fail("calibrated although one ships"))
    out = tmp_path / "cache" / "calibration.npz"
    got = ensure_calibration(model, out, corpus=corpus, n_tokens=256, window=64)
    assert np.array_equal(got.sites[(1, "down_in")].channel_absmax, made.sites[(1, "down_in")].channel_absmax)
    assert out.is_file()  # cached like a computed one


def test_other_settings_or_a_failed_content_hash_calibrate_instead(shipped, tmp_path, caplog):
    model, corpus, _, ship = shipped
    assert cal.shipped_calibration(model, corpus, 128, 64) is None  # not what shipped: calibrate
    data = bytearray((ship / "tiny.npz").read_bytes())
    data[100] ^= 0xFF
    (ship / "tiny.npz").write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert cal.shipped_calibration(model, corpus, 256, 64) is None
    assert "fails its content hash" in caplog.text


def test_the_default_model_calibration_ships(default_model):
    """The shipped file belongs to the default method's model (the rotated default model) and loads."""
    from hetero.methods import ROTATED, quant_model

    stats = cal.shipped_calibration(quant_model(default_model, ROTATED))
    assert stats is not None and stats.n_layers == default_model.config.n_layers
