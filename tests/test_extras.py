"""Optional dependencies: the core imports none of them, and a missing one is one clear error naming the
extra to install."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from hetero.errors import HeteroError, MissingExtra
from hetero.extras import EXTRAS, require

ROOT = Path(__file__).resolve().parents[1]


def test_core_imports_no_optional_library():
    code = ("import sys, hetero, hetero.cli, hetero.methods, hetero.npu.graph_backend, hetero.sched.measure; "
            "[hetero.cli.build_parser([c]) for c in hetero.cli.COMMANDS]; "
            f"print(sorted(m for m in {[m for m, _ in EXTRAS.values()]!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_missing_extra_names_it(extra, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingExtra, match=rf"needs {EXTRAS[extra][0]}: pip install 'hetero\[{extra}\]'") as e:
        require(extra, "this part")
    assert isinstance(e.value, HeteroError)  # the CLI prints it as one line, exit 2


def test_timeline_and_optimal_check_their_extra(monkeypatch):
    from hetero.sched import optimal, timeline

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingExtra, match=r"hetero\[plots\]"):
        timeline.plot_timeline([], "/tmp/never.png")
    with pytest.raises(MissingExtra, match=r"hetero\[optimal\]"):
        optimal.solve_optimal(None)
