"""The benchmarks live in the checkout's `bench/`, not in the installed package: `python bench/<name>.py` and
`hetero bench <name>` run them from a checkout, an install without them says where they are; a benchmark writes
the committed `bench/results/` only when `--out bench/results` asks, else `<cache>/bench/`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.entry import BENCHMARKS, default_out, out_dir
from hetero.cli import bench as cli_bench
from hetero.cli import main

ROOT = Path(__file__).resolve().parents[1]
DERIVED = ROOT / "hetero" / "profiles" / "snapdragon_8gen3_qwen1.5-1.8b.json"


def test_results_go_to_the_cache_unless_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    assert out_dir(None) == default_out() == tmp_path / "cache" / "bench"
    assert out_dir("bench/results") == Path("bench/results")


def test_every_benchmark_is_a_script_of_bench():
    for name in BENCHMARKS:
        assert 'sys.exit(script(__file__))' in (ROOT / "bench" / f"{name}.py").read_text(), name


def _committed_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--", "bench/results"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_a_quick_bench_leaves_the_committed_results_alone(tmp_path):
    """`python bench/sched.py --quick` (the cheapest bench with a quick mode: seconds) from another folder writes
    into `<cache>/bench/` and says so; `git status` of bench/results is what it was."""
    before = _committed_status()
    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "sched.py"), "--quick", "--profile", str(DERIVED),
                           "--opt-max-nodes", "0"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**_env(), "HETERO_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr
    assert _committed_status() == before
    assert {p.name for p in (cache / "bench").iterdir()} >= {"sched.json", "sched.md"}
    assert f"wrote {cache / 'bench' / 'sched.json'}" in done.stderr


def test_the_results_name_a_users_profile_from_the_cache(tmp_path, monkeypatch):
    from bench.sched import shown

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    assert shown(tmp_path / "profiles" / "host.json") == "<cache>/profiles/host.json"
    assert shown(DERIVED) == "hetero/profiles/snapdragon_8gen3_qwen1.5-1.8b.json"


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_hetero_bench_without_the_checkout_says_where_they_are(monkeypatch, capsys):
    """An installed wheel has no bench/: one line that says where the benchmarks are, exit 2."""
    monkeypatch.setattr(cli_bench, "checkout_bench", lambda: None)
    assert main(["bench", "prefill", "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bench/ folder of a source checkout" in err[0]


def test_hetero_bench_from_the_checkout_lists_every_benchmark(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in BENCHMARKS)


def test_the_package_imports_no_benchmark():
    """The wheel ships hetero/ alone: no module of it imports `bench` (`hetero bench` finds it through the
    checkout, `cli.bench.checkout_bench`)."""
    import ast

    found = []
    for path in sorted((ROOT / "hetero").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "bench"]
    assert found == []
