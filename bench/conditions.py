"""Whether a benchmark run can be trusted: the machine's load while it ran and the spread between
repeats. A starved run (other processes on the cores) still prints numbers; this says so beside them.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

LOAD_PER_CPU = 0.75  # 1-minute load average per CPU above which other work competes for the cores
SPREAD = 0.25  # (max - min) / median of a row's repeats above which its median is not trusted


def load_avg() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def trust_warnings(rows: list[dict[str, Any]], load_before: float, load_after: float,
                   cpus: int | None = None) -> list[str]:
    """One sentence per reason to distrust the real rows: a loaded machine, repeats that disagree."""
    cpus = cpus or os.cpu_count() or 1
    out = []
    load = max(load_before, load_after)
    if load > LOAD_PER_CPU * cpus:
        out.append(f"the machine was loaded: 1-minute load average {load_before:.1f} at the start, "
                   f"{load_after:.1f} at the end, on {cpus} CPUs; other processes competed for the cores, "
                   f"so timings and ratios are not reliable")
    for r in rows:
        runs = r.get("runs_ms") or []
        if r.get("simulated") or len(runs) < 2:
            continue
        spread = (max(runs) - min(runs)) / statistics.median(runs)
        if spread > SPREAD:
            out.append(f"{r['engine']} at {r['prompt_len']} tokens: repeats spread {spread:.0%} "
                       f"({min(runs):.0f}-{max(runs):.0f} ms)")
    return out
