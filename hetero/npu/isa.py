"""Which INT8 weight form the ONNX Runtime CPU EP runs exactly and fast on this CPU (read at run time).

ORT's u8·s8 `MatMulInteger` is exact with full 8-bit weights where the CPU has a VNNI dot product
(AVX-512 VNNI, AVX-VNNI, AMX-INT8: int32 accumulation). On AVX2 without VNNI it multiplies with
vpmaddubsw, whose int16 pair sums saturate unless |q| <= 64; the exact forms there are 7-bit weights
with u8·s8 or 8-bit weights with u8·u8 (`quantize.WEIGHT_FORMS`); docs/journal.md, "Weight forms".
"""

from __future__ import annotations

import logging
import platform

from hetero.cpu import cpu_flags
from hetero.errors import ConfigError
from hetero.outliers.quantize import WEIGHT_FORMS, check_weight_form

log = logging.getLogger(__name__)

VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
ISA_FLAGS = ("avx2", "avx512f", *VNNI_FLAGS)
FORM_VNNI = "w8-u8s8"  # exact and the fastest where a VNNI dot product exists
# AVX2 without VNNI: 8-bit weights through u8·u8, the same numbers as the VNNI form (hence the same
# answers on every machine), at a speed cost on those CPUs only; 7-bit weights flip answers where float is
# sure (tests/test_accuracy.py; docs/journal.md, "Weight forms").
FORM_AVX2 = "w8-u8u8"
# An NPU (QNN HTP) runs the paper's 8-bit weights in its own kernels, whatever this CPU's ISA; stored as the
# form every CPU EP runs exactly, so its decode graphs on the CPU (`cpu_form_for`) hold the same weights.
FORM_NPU = "w8-u8u8"


def has_vnni(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU has a VNNI int8 dot product (so u8·s8 with 8-bit weights is exact)."""
    return bool(set(VNNI_FLAGS) & (cpu_flags() if flags is None else flags))


def machine() -> dict:
    """What the CPU EP's optimized graphs depend on: the architecture and the int8-relevant ISA flags."""
    return {"machine": platform.machine(), "isa": sorted(set(ISA_FLAGS) & cpu_flags())}


def default_weight_form(flags: frozenset[str] | None = None) -> str:
    """The CPU-EP weight form for this CPU (or for `flags`): `FORM_VNNI` with VNNI, else `FORM_AVX2`."""
    return FORM_VNNI if has_vnni(flags) else FORM_AVX2


def resolve_weight_form(form: str | None, provider: str = "cpu") -> str:
    """`form` checked (None or "auto": the default of the provider kind, "cpu" (this CPU's) or "qnn"
    (`FORM_NPU`)); on the CPU EP, warns once when it is not exact here."""
    if provider not in ("cpu", "qnn"):
        raise ConfigError(f"provider kind must be 'cpu' or 'qnn', got {provider!r}")
    if form in (None, "auto"):
        return default_weight_form() if provider == "cpu" else FORM_NPU
    form = check_weight_form(form)
    if provider == "cpu" and WEIGHT_FORMS[form].needs_vnni and not has_vnni():
        log.warning("weight form %s runs u8·s8 with 8-bit weights, which saturates on this CPU (no VNNI): "
                    "results are not exact", form)
    return form


def cpu_form_for(form: str, flags: frozenset[str] | None = None) -> str:
    """The form in which this CPU's EP runs a plan's weights of `form` exactly and fast: this CPU's default
    when that holds the same integer weights (the same qmax: u8·s8 and u8·u8 of 8-bit weights give the same
    int32 sums where both are exact), else `form` itself (7-bit weights, exact everywhere). flags: another
    CPU's (default this one's)."""
    default = default_weight_form(flags)
    return default if WEIGHT_FORMS[check_weight_form(form)].qmax == WEIGHT_FORMS[default].qmax else form
