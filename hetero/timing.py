"""Median wall time of a callable: how hetero times anything it compares (profiles, benches, cost models);
the age of this process (what a command's start-up cost, before its own timers ran)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median of `repeats` timed calls of fn (time.perf_counter) after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def process_age_s() -> float | None:
    """Seconds since this process started: Linux's start time of the process (/proc/self/stat, in clock ticks
    of the boot clock: 10 ms resolution) against the boot clock now; None where either cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # the name in parentheses may hold spaces
        start = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start)
    except (OSError, ValueError, IndexError, AttributeError):  # no procfs, no boot clock (not Linux)
        return None


def best_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Fastest of `repeats` timed calls of fn after `warmup` untimed ones: a machine's best rate (a bound),
    which another process's burst on a shared core can only slow, never speed up."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
