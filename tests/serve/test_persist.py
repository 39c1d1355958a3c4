"""Contexts that survive a restart: saved on close and on request, verified at start, written atomically."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import hetero
from hetero.decode import SamplingParams
from hetero.serve import Service, StoreConfig

PARAMS = SamplingParams(max_new_tokens=6)
KEY = {"model": "test", "method": "float"}


def service(model: hetero.Model, folder: Path, key: dict = KEY) -> Service:
    return Service(hetero.Runtime(model, chunk=32), StoreConfig(block=16, exact=False), state_dir=folder, state_key=key)


def test_a_context_survives_a_restart(default_model: hetero.Model, tmp_path: Path) -> None:
    with service(default_model, tmp_path) as s:
        cid = s.create_context(system="Answer briefly.", client="alice")
        s.chat([{"role": "user", "content": "Name a colour."}], PARAMS, context_id=cid)
        second = s.chat([{"role": "user", "content": "And a fruit?"}], PARAMS, context_id=cid)
        history = list(s.context(cid).ids)
        messages = list(s.context(cid).messages)
        saved = s.save_context(cid, "alice")
        assert saved["kv_tokens"] == len(history) - 1  # all but the last token have K/V
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [f"{cid}.json", f"{cid}.kv.safetensors"]
    with service(default_model, tmp_path) as s:
        ctx = s.context(cid, "alice")
        assert ctx.ids == history and ctx.messages == messages
        third = s.chat([{"role": "user", "content": "And a city?"}], PARAMS, context_id=cid)
        assert third.usage.cached_tokens >= len(history) - 1 >= second.usage.prompt_tokens
        assert third.usage.recomputed_tokens == 0
    with service(default_model, tmp_path, {**KEY, "method": "hetero"}) as s:  # another method: not its K/V
        assert s.list_contexts() == []


def test_a_damaged_save_is_recomputed_with_a_warning(default_model: hetero.Model, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    with service(default_model, tmp_path) as s:
        cid = s.create_context()
        first = s.chat([{"role": "user", "content": "Name a colour."}], PARAMS, context_id=cid)
    kv = tmp_path / f"{cid}.kv.safetensors"
    data = bytearray(kv.read_bytes())
    data[-64:-48] = bytes(b ^ 0xFF for b in data[-64:-48])  # a flip, size and mtime kept
    stat = kv.stat()
    kv.write_bytes(bytes(data))
    import os

    os.utime(kv, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with caplog.at_level(logging.WARNING), service(default_model, tmp_path) as s:
        assert "fails verification" in caplog.text and cid in caplog.text
        again = s.chat([{"role": "user", "content": "Name a fruit."}], PARAMS, context_id=cid)
        assert again.usage.cached_tokens < first.usage.prompt_tokens  # nothing of the damaged K/V was used
        assert again.usage.prompt_tokens > first.usage.prompt_tokens  # the history itself was kept


def test_saved_kv_is_format_1_as_the_torch_writer_wrote_it(tmp_path: Path) -> None:
    """K/V is numpy now; its file is byte for byte what format 1's writer (safetensors' torch API) wrote, so
    contexts saved before still load (FORMAT stays 1), and a round trip is exact."""
    import numpy as np

    from hetero.serve import persist

    g = np.random.default_rng(0)
    k, v = (g.standard_normal((2, 3, 5, 4), dtype=np.float32) for _ in range(2))
    ctx = persist.SavedContext("ctx-1", "alice", None, [{"role": "user", "content": "hi"}], [1, 2, 3, 4, 5, 6],
                               1.0, k, v)
    persist.save(tmp_path, KEY, ctx)
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    save_file({"k": torch.from_numpy(k), "v": torch.from_numpy(v)}, str(tmp_path / "torch.safetensors"))
    assert (tmp_path / "ctx-1.kv.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()
    (got,) = persist.load_all(tmp_path, KEY)
    assert (got.ids, got.messages, got.client) == (ctx.ids, ctx.messages, "alice")
    assert isinstance(got.k, np.ndarray) and got.k.dtype == np.float32
    np.testing.assert_array_equal(got.k, k)
    np.testing.assert_array_equal(got.v, v)
