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


def peak_rss_mb(pid: int | str = "self") -> float | None:
    """The peak resident memory in MB of process `pid` since it was exec'd: its VmHWM (Linux; elsewhere this
    process's `ru_maxrss`, and None for another's or a process gone). Not `ru_maxrss` on Linux: through
    subprocess's vfork + exec it carries the parent's high-water mark into the child's, so every worker of a parent
    that once held 3.2 GB reported 3.2 GB (the gemma-3-1b rows of bench/results/scale.json, 2026-12-07: the peers
    step's in-process llama.cpp quantization)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    if pid == "self":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return None


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
