"""Optional dependencies: which pip extra brings which part, and one clear error when it is missing.

The core (load, calibrate, build graphs, prefill, decode) needs none of them; `pip install 'hetero[all]'`
brings every one. Each optional part calls `require(extra, what)` before importing its library.
"""

from __future__ import annotations

import importlib.util

from hetero.errors import MissingExtra

# extra -> (the module it provides, what it brings)
EXTRAS: dict[str, tuple[str, str]] = {
    "plots": ("matplotlib", "PNG plots: `hetero timeline --out`, the benchmarks' figures"),
    "optimal": ("ortools", "the scheduler's optimality reference (CP-SAT makespan, `hetero.sched.optimal`)"),
    "qnn": ("onnxruntime_qnn", "the QNN execution provider with the HTP backend (on x86 Linux: Qualcomm's HTP simulator)"),
}


def require(extra: str, what: str) -> None:
    """MissingExtra naming `pip install 'hetero[extra]'` unless the extra's library is importable."""
    module, _ = EXTRAS[extra]
    if importlib.util.find_spec(module) is None:
        raise MissingExtra(f"{what} needs {module}: pip install 'hetero[{extra}]'")
