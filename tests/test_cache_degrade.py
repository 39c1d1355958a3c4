"""The whole cache of a (tiny) model under damage and on disks that refuse writes: every file flipped with its
mtime kept, a read-only bind mount in any state, a full tmpfs. The model, its rotated copy, calibration and graphs
go through the real code paths (`load_model`, `methods.quant_setup`, `NpuBackend`); the answer must equal the cold
run's every time."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from hetero.cli.cache import verify_cache
from tests.conftest import make_tiny_model
from tests.gguf_writer import write_gguf
from tests.outliers.test_calibrate import ByteTokenizer


def run_pipeline(gguf: Path) -> torch.Tensor:
    """Load, rotate, calibrate and build the graphs of layer 0 from the cache at $HETERO_CACHE; its output."""
    from hetero.loader import load_model
    from hetero.methods import quant_setup
    from hetero.npu.graph_backend import NpuBackend

    model = dataclasses.replace(load_model(gguf), tokenizer=ByteTokenizer())
    qm, plan = quant_setup(model)
    be = NpuBackend(qm, plan, 16, layers=[0])
    h = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    return be.qkv(0, h)[0]


def cache_files(root: Path) -> list[Path]:
    """Every non-empty file of the cache but lock files: what the probe flipped."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix != ".lock" and p.stat().st_size > 0)


def flip_keeping_mtime(p: Path) -> None:
    """XOR 3 × 16 bytes spread over the file, then put its stamps back (bit rot, a `cp -p` restore)."""
    st = p.stat()
    data = bytearray(p.read_bytes())
    for frac in (0.25, 0.5, 0.75):
        i = min(int(len(data) * frac), max(0, len(data) - 16))
        data[i:i + 16] = bytes(b ^ 0x5A for b in data[i:i + 16])
    p.write_bytes(bytes(data))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def read_only_view(src: Path, where: Path):
    """`src` seen read-only at `where` (a ro bind mount: root ignores mode bits); skips where not permitted."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        _mount("--bind", str(src), str(where))
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"bind mounts are not permitted here ({getattr(e, 'stderr', e)})")
    try:
        _mount("-o", "remount,ro,bind", str(where))
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)  # lazy: weights may still be mapped


@contextlib.contextmanager
def small_disk(where: Path, size: str):
    """A tmpfs of `size` at `where` (a full disk); skips where mounting is not permitted."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where))
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"tmpfs mounts are not permitted here ({getattr(e, 'stderr', e)})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def tiny_gguf(tmp_path):
    return write_gguf(make_tiny_model(), tmp_path / "tiny.gguf")


@pytest.fixture
def warm(tmp_path, tiny_gguf, monkeypatch):
    """(cache folder, reference output) after a cold run into a fresh cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("HETERO_CACHE", str(cache))
    return cache, run_pipeline(tiny_gguf)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_every_file_flipped_with_its_mtime_kept_is_rebuilt(warm, tiny_gguf, caplog):
    cache, ref = warm
    files = cache_files(cache)
    names = {p.name for p in files}
    assert {"weights.safetensors", "calibration.npz", "compiled.onnx", "meta.json", "record.json"} <= names
    for p in files:
        flip_keeping_mtime(p)
    with caplog.at_level(logging.WARNING):
        again = run_pipeline(tiny_gguf)
    assert np.array_equal(again, ref)
    text = "\n".join(_warnings(caplog))
    assert "model cache entry" in text and "rotated weights" in text and "calibration" in text
    assert "graph cache entry" in text
    assert verify_cache(cache)[1] == []  # repaired on disk
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert np.array_equal(run_pipeline(tiny_gguf), ref)
    assert _warnings(caplog) == []  # and quiet from then on


def test_read_only_cache_runs_from_any_state(warm, tiny_gguf, tmp_path, monkeypatch, caplog):
    cache, ref = warm
    with read_only_view(cache, tmp_path / "ro-warm") as view:  # everything verifies, nothing to write: quiet
        monkeypatch.setenv("HETERO_CACHE", str(view))
        with caplog.at_level(logging.WARNING):
            assert np.array_equal(run_pipeline(tiny_gguf), ref)
        assert _warnings(caplog) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    with read_only_view(empty, tmp_path / "ro-cold") as view:  # everything computed for this run, one warning
        monkeypatch.setenv("HETERO_CACHE", str(view))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert np.array_equal(run_pipeline(tiny_gguf), ref)
        warnings = _warnings(caplog)
        assert len(warnings) == 1 and "running uncached" in warnings[0] and "Read-only file system" in warnings[0]
    for p in cache_files(cache):
        if p.name in ("weights.safetensors", "calibration.npz", "compiled.onnx"):
            flip_keeping_mtime(p)
    with read_only_view(cache, tmp_path / "ro-damaged") as view:  # unrepairable: recomputed for this run
        monkeypatch.setenv("HETERO_CACHE", str(view))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert np.array_equal(run_pipeline(tiny_gguf), ref)
        text = "\n".join(_warnings(caplog))
        assert "running uncached" in text and "fails its content hash (corrupt); computing it for this run" in text
    # the damage is still there (nothing could be repaired): the rotated copy and its calibration (the unrotated
    # float weights are not kept: rotation read the GGUF) ...
    assert {Path(f.path).name for f in verify_cache(cache)[1]} >= {"weights.safetensors", "calibration.npz"}
    assert verify_cache(cache)[1] == []  # ... until the cache is writable again


@pytest.mark.parametrize("size", ["64k", "400k"])
def test_full_disk_runs_uncached_and_leaves_no_partial_entry(tiny_gguf, tmp_path, monkeypatch, caplog, size):
    ref_cache = tmp_path / "ref"
    monkeypatch.setenv("HETERO_CACHE", str(ref_cache))
    ref = run_pipeline(tiny_gguf)
    with small_disk(tmp_path / "small", size) as disk:
        monkeypatch.setenv("HETERO_CACHE", str(disk))
        with caplog.at_level(logging.WARNING):
            assert np.array_equal(run_pipeline(tiny_gguf), ref)
        warnings = _warnings(caplog)
        assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings
        assert verify_cache(disk)[1] == []  # what was kept verifies; nothing half-written
        assert not [p for p in disk.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".build-")]
        for d in [p for p in [*disk.glob("models/*"), *disk.glob("graphs/*/*")] if p.is_dir()]:  # the entries
            assert d.name == ".locks" or any(d.iterdir()), f"empty entry {d} left behind"
        caplog.clear()
        with caplog.at_level(logging.WARNING):  # and the next run, on what was kept, agrees
            assert np.array_equal(run_pipeline(tiny_gguf), ref)
    shutil.rmtree(ref_cache)


def test_cache_verify_reports_and_repairs_a_planted_flip(warm, tiny_gguf, tmp_path, capsys):
    from hetero.cli import main

    cache, ref = warm
    assert main(["cache", "verify"]) == 0
    assert "all intact" in capsys.readouterr().out
    rotated = next(cache.glob("models/*-rot1s0/weights.safetensors"))
    graph = next(cache.glob("graphs/ort-cpu/*/compiled.onnx"))
    for p in (rotated, graph):
        flip_keeping_mtime(p)
    with read_only_view(cache, tmp_path / "ro") as view, pytest.MonkeyPatch.context() as mp:
        mp.setenv("HETERO_CACHE", str(view))
        assert main(["cache", "verify"]) == 1  # found, but a read-only cache cannot be repaired
        out = capsys.readouterr().out
        assert "2 damaged" in out and out.count("NOT repaired") == 2
    assert main(["cache", "verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {d["path"] for d in report["damaged"]} == {str(rotated), str(graph.parent)}
    assert all(d["repaired"] and "fails its content hash" in d["why"] for d in report["damaged"])
    assert not rotated.exists() and not graph.parent.exists()  # removed: the next run rebuilds them
    assert main(["cache", "verify"]) == 0 and "all intact" in capsys.readouterr().out
    assert np.array_equal(run_pipeline(tiny_gguf), ref)


def test_cache_verify_creates_nothing_where_there_is_no_cache(tmp_path, monkeypatch, capsys):
    """`hetero cache verify` once created a missing cache folder; it says there is nothing to verify."""
    from hetero.cli import main

    missing = tmp_path / "no-cache"
    monkeypatch.setenv("HETERO_CACHE", str(missing))
    assert main(["cache", "verify"]) == 0
    assert f"nothing to verify: there is no cache at {missing}" in capsys.readouterr().out
    assert main(["cache", "verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checked"] == 0
    assert not missing.exists()
