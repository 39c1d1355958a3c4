"""OpenMP's wait policy: importing hetero changes no environment variable; the edges (the `hetero` command, a
benchmark's process) make OpenMP wait passively before torch loads; baseline engines keep the libraries' default."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetero import threads
from hetero.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

_IMPORT_ALL = """
import importlib, json, os, pkgutil, sys
before = dict(os.environ)
import hetero
hetero.Runtime, hetero.make_runtime  # the public names, loaded on first use
for m in pkgutil.walk_packages(hetero.__path__, "hetero."):
    if not m.name.endswith("__main__"):
        importlib.import_module(m.name)
changed = {k: (before.get(k), os.environ.get(k)) for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}
print(json.dumps(changed))
"""


def _child(code: str, env: dict[str, str]) -> str:
    res = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1]


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (threads.WAIT_POLICY, threads.KEEP)}


def test_importing_hetero_leaves_the_environment_unchanged():
    """Every module of hetero imported, with no policy set and with the user's: os.environ as it was."""
    assert _child(_IMPORT_ALL, _base_env()) == "{}"
    assert _child(_IMPORT_ALL, {**_base_env(), threads.WAIT_POLICY: "ACTIVE"}) == "{}"


def test_importing_hetero_loads_no_torch():
    """So that an entry point still chooses OpenMP's wait policy after `import hetero` (and `hetero.cli`)."""
    code = "import sys, hetero, hetero.cli, bench.entry; print('torch' in sys.modules)"
    assert _child(code, _base_env()) == "False"


_CLI_POLICY = """
import os
from hetero.cli import main
try:
    main(["--version"])
except SystemExit:
    pass
import torch
from hetero.threads import passive_in_effect
print(os.environ.get("OMP_WAIT_POLICY", "<unset>"), passive_in_effect())
"""


def test_the_hetero_command_waits_passively_unless_the_user_chose():
    env = _base_env()
    assert _child(_CLI_POLICY, env) == "PASSIVE True"
    assert _child(_CLI_POLICY, {**env, threads.WAIT_POLICY: "ACTIVE"}) == "ACTIVE False"
    assert _child(_CLI_POLICY, {**env, threads.KEEP: "default"}) == "<unset> False"


def test_passive_openmp_sets_nothing_once_torch_is_loaded():
    code = "import os, torch; from hetero.threads import passive_openmp; print(passive_openmp(), 'OMP_WAIT_POLICY' in os.environ)"
    assert _child(code, _base_env()) == "False False"


def test_passive_env_for_a_child_process():
    assert threads.passive_env({"PATH": "/bin"}) == {"PATH": "/bin", threads.WAIT_POLICY: "PASSIVE"}
    assert threads.passive_env({threads.WAIT_POLICY: "ACTIVE"}) == {threads.WAIT_POLICY: "ACTIVE"}
    assert threads.WAIT_POLICY not in threads.passive_env({threads.KEEP: "default"})


def test_library_default_env_restores_the_users_policy(monkeypatch):
    monkeypatch.setattr(threads, "USER_WAIT_POLICY", None)
    env = threads.library_default_env({"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"})
    assert env == {"PATH": "/bin", threads.KEEP: "default"}
    assert _child(_CLI_POLICY, {**_base_env(), **env}) == "<unset> False"
    monkeypatch.setattr(threads, "USER_WAIT_POLICY", "ACTIVE")
    assert threads.library_default_env({"OMP_WAIT_POLICY": "PASSIVE"})[threads.WAIT_POLICY] == "ACTIVE"


def test_passive_in_effect_reads_the_policy(monkeypatch):
    monkeypatch.setenv(threads.WAIT_POLICY, " passive")
    assert threads.passive_in_effect()
    monkeypatch.setenv(threads.WAIT_POLICY, "ACTIVE")
    assert not threads.passive_in_effect()
    monkeypatch.delenv(threads.WAIT_POLICY)
    assert not threads.passive_in_effect()  # libgomp's default: spin


_DECODE_CHILD = """
import hashlib, torch
from hetero.decode.step import DecodeStep
from hetero.decode.tree import TokenTree
from hetero.npu.graph_backend import NpuBackend
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model
from tests.npu.conftest import SHADOWS, tiny_plan
m = make_tiny_model()
rt = Runtime(m, chunk=16, backend=NpuBackend(m, tiny_plan(m, SHADOWS), 16, provider="cpu"))
r = rt.prefill(torch.arange(3, 30))
step = DecodeStep(rt)
out = step.forward(r.cache, TokenTree([7], [-1]))
per_session = step.backend(1).program(0).runs[0].graph.session.get_session_options().use_per_session_threads
print(per_session, hashlib.sha256(out.tobytes()).hexdigest(), step.pool is None)
"""


def test_shared_ort_pool_runs_every_session_on_it_with_the_same_results(tmp_path):
    """$HETERO_ORT_POOL=shared: hetero's sessions (graphs, decode head) use the process's pool, and an INT8
    decode step's logits are those of the per-session pools bit for bit (integer matmuls, row-wise float ops)."""
    root = ROOT
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
