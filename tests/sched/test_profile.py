import json

import pytest

from hetero.errors import ConfigError
from hetero.sched.profile import CostEntry, Profile, load_profile, save_profile


def test_cost_interpolates_and_extrapolates_attention(profile):
    # attn C=2: (2, 6us) -> (16, 20us): affine in kv_len, extended past both ends
    assert profile.cost_us("attn", "cpu", 2, 2) == pytest.approx(6.0)
    assert profile.cost_us("attn", "cpu", 2, 9) == pytest.approx(13.0)
    assert profile.cost_us("attn", "cpu", 2, 30) == pytest.approx(34.0)
    assert profile.cost_us("qkv", "npu", 4, 1234) == pytest.approx(12.0)  # static: kv_len ignored


def test_missing_entry_names_what_exists(profile):
    with pytest.raises(ConfigError, match="C=3"):
        profile.cost_us("qkv", "npu", 3)


def test_roundtrip_keeps_costs_and_metadata(profile, tmp_path):
    path = save_profile(profile, tmp_path / "p.json")
    back = load_profile(path)
    assert back == profile and hash(back) == hash(profile)
    assert back.metadata["notes"] == "test fixture" and back.n_layers == 2
    assert json.loads(path.read_text())["version"] == 1


def test_bad_profiles_raise_config_error(tmp_path):
    with pytest.raises(ConfigError):
        CostEntry("attn", "cpu", 2, ((4, 1.0), (2, 2.0)))
    with pytest.raises(ConfigError):
        Profile(name="x", method="guessed", simulated=True, costs=())
    (tmp_path / "bad.json").write_text('{"version": 1, "name": "x"}')
    with pytest.raises(ConfigError, match="malformed"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile(tmp_path / "none.json")


def test_committed_profiles_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "hetero" / "profiles"
    derived = load_profile(root / "snapdragon_8gen3_qwen1.5-1.8b.json")
    assert derived.method == "derived" and derived.simulated and "315" in derived.metadata["derivation"]
    # §3.4: NPU ~ 2x CPU for a 256-token prompt (one chunk of 256)
    npu = derived.n_layers * (derived.cost_us("qkv", "npu", 256) + derived.cost_us("o_ffn", "npu", 256))
    cpu = derived.n_layers * derived.cost_us("attn", "cpu", 256, 256)
    assert npu == pytest.approx(315e3) and npu / cpu == pytest.approx(2.0)
    for p in root.glob("*.json"):
        prof = load_profile(p)
        assert prof.method in ("measured", "derived")
        assert {"device", "date", "versions"} <= set(prof.metadata)
