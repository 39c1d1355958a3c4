"""OpenMP wait policy: hetero's processes wait passively; baseline engines keep the libraries' default."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetero import threads
from hetero.errors import ConfigError


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


_DECODE_CHILD = """
import hashlib, torch
from hetero.decode.step import DecodeStep
from hetero.decode.tree import TokenTree
from hetero.npu.backend import NpuBackend
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model
from tests.npu.conftest import SHADOWS, tiny_plan
m = make_tiny_model()
rt = Runtime(m, chunk=16, backend=NpuBackend(m, tiny_plan(m, SHADOWS), 16, provider="cpu"))
r = rt.prefill(torch.arange(3, 30))
step = DecodeStep(rt)
out = step.forward(r.cache, TokenTree([7], [-1]))
per_session = step.backend(1).program(0).runs[0].graph.session.get_session_options().use_per_session_threads
print(per_session, hashlib.sha256(out.numpy().tobytes()).hexdigest(), step.pool is None)
"""


def test_shared_ort_pool_runs_every_session_on_it_with_the_same_results(tmp_path):
    """$HETERO_ORT_POOL=shared: hetero's sessions (graphs, decode head) use the process's pool, and an INT8
    decode step's logits are those of the per-session pools bit for bit (integer matmuls, row-wise float ops)."""
    root = Path(__file__).resolve().parents[1]
    env = {**_base_env(), "PYTHONPATH": str(root), "HETERO_CACHE": str(tmp_path / "cache")}
    outs = {}
    for mode in ("session", "shared"):
        res = subprocess.run([sys.executable, "-c", _DECODE_CHILD], env={**env, threads.ORT_POOL: mode}, cwd=root,
                             capture_output=True, text=True, check=True)
        outs[mode] = res.stdout.split()
        if mode == "shared":  # no session names a thread count there (ONNX Runtime would warn for each)
            assert "are ignored when using a global thread pool" not in res.stderr
    assert outs["session"][0] == "True" and outs["shared"][0] == "False"
    assert outs["session"][1] == outs["shared"][1]
    assert outs["shared"][2] == "True"  # no attention helper beside the shared pool's spinning threads


def test_ort_pool_mode_is_checked(monkeypatch):
    monkeypatch.setenv(threads.ORT_POOL, "global")
    with pytest.raises(ConfigError, match=threads.ORT_POOL):
        threads.shared_ort_pool()
    monkeypatch.setenv(threads.ORT_POOL, "")
    assert not threads.shared_ort_pool()
