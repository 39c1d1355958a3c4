"""OpenMP wait policy: hetero's processes wait passively; baseline engines keep the libraries' default."""

import os
import subprocess
import sys

from hetero import threads


def _policy_in_child(env: dict[str, str]) -> str:
    code = "import hetero, os; print(os.environ.get('OMP_WAIT_POLICY', '<unset>'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (threads.WAIT_POLICY, threads.KEEP)}


def test_import_sets_passive_unless_the_user_chose():
    env = _base_env()
    assert _policy_in_child(env) == "PASSIVE"
    assert _policy_in_child({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
    assert _policy_in_child({**env, threads.KEEP: "default"}) == "<unset>"


def test_library_default_env_restores_the_users_policy(monkeypatch):
    monkeypatch.setattr(threads, "USER_WAIT_POLICY", None)
    env = threads.library_default_env({"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"})
    assert env == {"PATH": "/bin", threads.KEEP: "default"}
    assert _policy_in_child({**_base_env(), **env}) == "<unset>"
    monkeypatch.setattr(threads, "USER_WAIT_POLICY", "ACTIVE")
    assert threads.library_default_env({"OMP_WAIT_POLICY": "PASSIVE"})[threads.WAIT_POLICY] == "ACTIVE"


def test_passive_in_effect_follows_what_libgomp_read(monkeypatch):
    monkeypatch.setattr(threads, "USER_WAIT_POLICY", None)
    monkeypatch.delenv(threads.KEEP, raising=False)
    monkeypatch.setattr(threads, "TORCH_FIRST", False)
    assert threads.passive_in_effect()
    monkeypatch.setattr(threads, "TORCH_FIRST", True)  # torch loaded first: libgomp kept its spin-wait
    assert not threads.passive_in_effect()
    monkeypatch.setattr(threads, "USER_WAIT_POLICY", " passive")
    assert threads.passive_in_effect()
    monkeypatch.setattr(threads, "USER_WAIT_POLICY", "ACTIVE")
    assert not threads.passive_in_effect()
