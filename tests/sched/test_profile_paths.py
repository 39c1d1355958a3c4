"""Profiles: shipped ones are read-only package data; the user's measured ones live in the user cache and
are read first (issue 14, packaging)."""

from __future__ import annotations

import json

from hetero.paths import PROFILES_DIR, profile_search_path, user_profiles_dir
from hetero.sched.measure import host_profile, host_slug


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
