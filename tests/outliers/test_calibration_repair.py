"""A damaged calibration file is recalibrated with a warning, damage behind a kept mtime too; two processes
starting cold calibrate once; bad corpus and output paths are ConfigErrors."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from hetero.errors import ConfigError
from hetero.outliers.calibration import CalibrationStats, ensure_calibration
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
    assert caplog.text.count("rebuilding it") == 1 and "truncated or replaced" in caplog.text  # other size
    assert np.array_equal(again.sites[(1, "ffn_in")].channel_absmax, good.sites[(1, "ffn_in")].channel_absmax)
    CalibrationStats.load(path, model)  # repaired on disk


def test_damage_behind_a_kept_mtime_is_recomputed(setup, caplog):
    model, corpus, path = setup
    good = _ensure(model, corpus, path)
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with caplog.at_level(logging.WARNING):
        again = _ensure(model, corpus, path)
    assert "fails its content hash" in caplog.text
    assert np.array_equal(again.sites[(0, "attn_in")].counts, good.sites[(0, "attn_in")].counts)


def _calibrate_in_child(path: str, corpus: str, barrier, log_path: str) -> None:
    """One cold process: counts its own calibrations in `log_path` (slowed down, so that the two overlap)."""
    from hetero.outliers import calibration as cal
    from tests.conftest import make_tiny_model

    real = cal.calibrate

    def counted(*args, **kwargs):
        with open(log_path, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)
        return real(*args, **kwargs)

    cal.calibrate = counted
    model = dataclasses.replace(make_tiny_model(), tokenizer=ByteTokenizer())
    barrier.wait()
    cal.ensure_calibration(model, path, corpus=corpus, n_tokens=256, window=64)


def test_two_cold_processes_calibrate_once(setup, tmp_path):
    _, corpus, path = setup
    ctx = mp.get_context("spawn")
    barrier, log_path = ctx.Barrier(2), tmp_path / "calibrations.txt"
    procs = [ctx.Process(target=_calibrate_in_child, args=(str(path), corpus, barrier, str(log_path)))
             for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    assert len(log_path.read_text().split()) == 1  # the entry's lock covered the run: the other one waited
    CalibrationStats.load(path)


def test_unwritable_calibration_path_warns_and_runs(setup, caplog):
    model, corpus, _ = setup
    with caplog.at_level(logging.WARNING):
        stats = _ensure(model, corpus, "/proc/x/calibration.npz")
    assert "running uncached" in caplog.text and stats.n_tokens == 256
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
