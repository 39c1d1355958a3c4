"""Which CPU measured a benchmark: its model name, microarchitecture and the ISA flags that set int8 and
bf16 GEMM speed. A ratio between engines holds on the CPU that measured it (a Zen 4 is not a Zen 5, nor a
Sapphire Rapids with AMX), so every result names it.
"""

from __future__ import annotations

import platform
from typing import Any

from hetero.cpu import cpu_flags

# The flags that decide which int8 / bf16 kernels a runtime can use on x86 (VNNI dot products, BF16, AMX tiles).
MATTERING_FLAGS = ("avx2", "avx512f", "avx_vnni", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")

# (vendor, family, first model, last model) -> microarchitecture, after the vendors' published CPUID tables.
_MICROARCH: tuple[tuple[str, int, int, int, str], ...] = (
    ("AuthenticAMD", 23, 0x00, 0x2F, "Zen / Zen+"),
    ("AuthenticAMD", 23, 0x30, 0xFF, "Zen 2"),
    ("AuthenticAMD", 25, 0x00, 0x0F, "Zen 3"),
    ("AuthenticAMD", 25, 0x10, 0x1F, "Zen 4"),
    ("AuthenticAMD", 25, 0x20, 0x5F, "Zen 3"),
    ("AuthenticAMD", 25, 0x60, 0xAF, "Zen 4"),
    ("AuthenticAMD", 26, 0x00, 0xFF, "Zen 5"),
    ("GenuineIntel", 6, 0x55, 0x55, "Skylake-SP / Cascade Lake"),
    ("GenuineIntel", 6, 0x6A, 0x6C, "Ice Lake-SP"),
    ("GenuineIntel", 6, 0x7D, 0x7E, "Ice Lake"),
    ("GenuineIntel", 6, 0x8C, 0x8D, "Tiger Lake"),
    ("GenuineIntel", 6, 0x8F, 0x8F, "Sapphire Rapids"),
    ("GenuineIntel", 6, 0x97, 0x9A, "Alder Lake"),
    ("GenuineIntel", 6, 0xAA, 0xAC, "Meteor Lake"),
    ("GenuineIntel", 6, 0xAD, 0xAE, "Granite Rapids"),
    ("GenuineIntel", 6, 0xAF, 0xAF, "Sierra Forest"),
    ("GenuineIntel", 6, 0xB7, 0xB7, "Raptor Lake"),
    ("GenuineIntel", 6, 0xBA, 0xBA, "Raptor Lake"),
    ("GenuineIntel", 6, 0xBD, 0xBD, "Lunar Lake"),
    ("GenuineIntel", 6, 0xBF, 0xBF, "Raptor Lake"),
    ("GenuineIntel", 6, 0xC5, 0xC6, "Arrow Lake"),
    ("GenuineIntel", 6, 0xCF, 0xCF, "Emerald Rapids"),
)


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where it cannot be read)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def microarchitecture(vendor: str, family: int, model: int) -> str:
    """The microarchitecture of a CPUID (vendor, family, model), or 'unknown (...)' naming the numbers."""
    for v, fam, lo, hi, name in _MICROARCH:
        if v == vendor and fam == family and lo <= model <= hi:
            return name
    return f"unknown ({vendor} family {family} model {model:#x})"


def host() -> dict[str, Any]:
    """The CPU that runs this process: model name, microarchitecture, the flags that matter, core count."""
    import os

    info = _cpuinfo()
    vendor = info.get("vendor_id", "")
    try:
        arch = microarchitecture(vendor, int(info.get("cpu family", "-1")), int(info.get("model", "-1")))
    except ValueError:
        arch = "unknown"
    flags = cpu_flags()
    return {"cpu": info.get("model name") or platform.processor() or platform.machine(),
            "microarchitecture": arch, "machine": platform.machine(),
            "isa": [f for f in MATTERING_FLAGS if f in flags], "cpus": os.cpu_count() or 0,
            "hypervisor": "hypervisor" in flags}


def describe(h: dict[str, Any]) -> str:
    """One line for a result's header: 'AMD EPYC (Zen 4), 2 CPUs, avx512_vnni avx512_bf16, no AMX'."""
    isa = " ".join(f for f in h["isa"] if f not in ("avx2", "avx512f")) or "no VNNI/BF16"
    amx = "" if any(f.startswith("amx") for f in h["isa"]) else ", no AMX"
    vm = ", a VM" if h.get("hypervisor") else ""
    return f"{h['cpu']} ({h['microarchitecture']}), {h['cpus']} CPUs{vm}, {isa}{amx}"
