"""A damaged calibration file is recalibrated with a warning; bad corpus and output paths are ConfigErrors
(issue 14, defects 3 and 5)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from hetero.errors import ConfigError
from hetero.outliers.calibrate import CalibrationStats, ensure_calibration
from hetero.outliers.corpus import load_corpus
from tests.outliers.test_calibrate import TEXT, ByteTokenizer


@pytest.fixture
def setup(tiny, tmp_path):
    model = dataclasses.replace(tiny, tokenizer=ByteTokenizer())
    corpus = tmp_path / "fox.txt"
    corpus.write_text(TEXT)
    return model, str(corpus), tmp_path / "calibration.npz"


def _ensure(model, corpus, path):
    return ensure_calibration(model, path, corpus=corpus, n_tokens=256, window=64)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_calibration_is_recomputed(setup, damage, caplog):
    model, corpus, path = setup
    good = _ensure(model, corpus, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00garbage" * 100)
    with caplog.at_level(logging.WARNING):
        again = _ensure(model, corpus, path)
    assert "corrupt" in caplog.text and "recalibrating" in caplog.text
    assert np.array_equal(again.sites[(1, "ffn_in")].channel_absmax, good.sites[(1, "ffn_in")].channel_absmax)
    CalibrationStats.load(path, model)  # repaired on disk


def test_unwritable_calibration_path_warns_and_runs(setup, caplog):
    model, corpus, _ = setup
    with caplog.at_level(logging.WARNING):
        stats = _ensure(model, corpus, "/proc/x/calibration.npz")
    assert "cannot be written" in caplog.text and stats.n_tokens == 256
    with pytest.raises(ConfigError, match="calibration output '/proc/x.npz' cannot be written"):
        stats.save("/proc/x.npz")


def test_binary_or_non_utf8_corpus_is_a_config_error(tmp_path):
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_corpus(str(binary))
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"text\x00with\x00nuls")
    with pytest.raises(ConfigError, match="binary"):
        load_corpus(str(nul))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        load_corpus(str(tmp_path / "empty.txt"))
