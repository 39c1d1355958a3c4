"""What this CPU can do: its feature flags, read once (the INT8 weight form, `npu.isa`; the BF16 attention
kernel, `native.attention`; the benches' host record)."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of this machine (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        line = ""
    return frozenset(line.partition(":")[2].split())
