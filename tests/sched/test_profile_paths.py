"""Profiles: shipped ones are read-only package data; the user's measured ones live in the user cache and
are read first (an installed package's files are not written)."""

from __future__ import annotations

import json

from hetero.paths import PROFILES_DIR, profile_search_path, user_profiles_dir
import pytest

from hetero.sched.measure import NotMeasured, host_profile, host_slug


def test_shipped_profiles_are_inside_the_package():
    import hetero

    assert PROFILES_DIR.parent == __import__("pathlib").Path(hetero.__file__).parent
    assert (PROFILES_DIR / "snapdragon_8gen3_qwen1.5-1.8b.json").is_file()


def test_user_profile_is_read_before_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    assert profile_search_path() == [tmp_path / "profiles", PROFILES_DIR]
    shipped = next(p for p in sorted(PROFILES_DIR.glob("*.json")) if json.loads(p.read_text()).get("method") == "measured")
    data = json.loads(shipped.read_text())
    data["name"] = "measured-by-the-user"
    user_profiles_dir().mkdir(parents=True)
    (user_profiles_dir() / f"{host_slug()}.json").write_text(json.dumps(data))
    assert host_profile().name == "measured-by-the-user"


def _profile(tmp_path, monkeypatch, kinds, placement, fingerprint="m1", chunk_lens=(32, 64)):
    """`hetero profile`'s writer with a runner that times `kinds` at once, into the user's <host>.json."""
    from hetero.sched.measure import profile_command

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    return profile_command(None, lambda kind, lane, c, kv: None, kinds=kinds, lanes=("npu", "cpu"), chunk_lens=chunk_lens,
                           kv_lens=(256,), repeats=1, n_layers=2, layer_subgraphs=placement, log=None,
                           metadata={"model": {"fingerprint": fingerprint}})


LANES = (("qkv", "npu"), ("attn", "cpu"), ("o_ffn", "npu"))
HALVES = (("layer_attn", "npu"), ("layer_ffn", "npu"))


def test_profiling_one_method_keeps_the_costs_of_another(tmp_path, monkeypatch):
    """Profiling the default method (its whole-layer halves) keeps the costs `hetero-lanes` dispatches on: it once
    replaced that file, leaving it no qkv/attn/o_ffn cost."""
    from hetero.errors import ConfigError
    from hetero.sched.measure import profile_command

    _profile(tmp_path, monkeypatch, ["qkv", "attn", "o_ffn"], LANES)
    _profile(tmp_path, monkeypatch, ["layer_attn", "layer_ffn"], HALVES, chunk_lens=(64,))
    path = user_profiles_dir() / f"{host_slug()}.json"
    got = json.loads(path.read_text())
    assert {(c["kind"], c["chunk_len"]) for c in got["costs"]} == \
        {(k, c) for k in ("qkv", "attn", "o_ffn") for c in (32, 64)} | {("layer_attn", 64), ("layer_ffn", 64)}
    assert [tuple(x) for x in got["layer_subgraphs"]] == list(LANES)  # still the placement a scheduler dispatches
    assert host_profile(LANES).has("qkv", "npu", 32) and host_profile(HALVES).has("layer_attn", "npu", 64)

    _profile(tmp_path, monkeypatch, ["layer_attn", "layer_ffn"], HALVES, fingerprint="m2")  # another model's
    assert {c["kind"] for c in json.loads(path.read_text())["costs"]} == {"layer_attn", "layer_ffn"}

    before = path.read_bytes()
    with pytest.raises(ConfigError, match="nothing to write"):  # a method whose subgraphs the runner cannot time
        profile_command(None, lambda *a: (_ for _ in ()).throw(NotMeasured()), kinds=["qkv"], lanes=("npu",),
                        chunk_lens=(32,), repeats=1, n_layers=2, log=None)
    assert path.read_bytes() == before


def test_a_method_whose_kinds_this_hosts_profile_lacks_runs_on_shipped_costs(tmp_path, monkeypatch, caplog):
    """`hetero run --method hetero-lanes` after profiling only the default method: the shipped costs, a warning
    that says why, never exit 2; a learning executor starts from them and runs."""
    import logging

    import numpy as np

    from hetero.runtime import Runtime
    from hetero.sched.executor import OutOfOrderExecutor
    from tests.conftest import make_tiny_model

    _profile(tmp_path, monkeypatch, ["layer_attn", "layer_ffn"], HALVES)
    assert host_profile().has("layer_attn", "npu", 32)  # nothing asked for: this host's, as before
    with caplog.at_level(logging.WARNING):
        prof = host_profile(LANES)
    assert prof.method == "measured" and all(prof.has(k, lane, 256) for k, lane in LANES)
    assert "has no cost for [('attn', 'cpu'), ('o_ffn', 'npu'), ('qkv', 'npu')]" in caplog.text
    model = make_tiny_model()
    ex = OutOfOrderExecutor(model.config.n_layers, 16, "rank", learn_key="tiny-after-profile")
    rt = Runtime(model, chunk=16, executor=ex)
    try:
        assert rt.prefill(np.arange(40) % 256).schedule is not None  # 3 chunks, dispatched on the shipped costs
    finally:
        rt.close()
