"""The weight form follows the CPU's ISA (`hetero.npu.isa`), and can be forced down the stack."""

from __future__ import annotations

import pytest

from hetero.cli import main
from hetero.errors import ConfigError
from hetero.cpu import cpu_flags
from hetero.npu import isa


@pytest.mark.parametrize("flags, form", [
    ({"avx2", "avx512f", "avx512_vnni"}, "w8-u8s8"),
    ({"avx2", "avx_vnni"}, "w8-u8s8"),
    ({"avx2", "amx_int8"}, "w8-u8s8"),
    ({"avx2", "fma"}, isa.FORM_AVX2),
    (set(), isa.FORM_AVX2),
])
def test_default_weight_form_by_flags(flags, form):
    assert isa.default_weight_form(frozenset(flags)) == form
    assert isa.FORM_AVX2 != "w8-u8s8"  # 8-bit u8·s8 saturates without VNNI: never the AVX2 default


def test_resolve_weight_form_forces_or_picks_this_cpus():
    assert isa.resolve_weight_form(None) == isa.resolve_weight_form("auto") == isa.default_weight_form()
    assert isa.resolve_weight_form("w7-u8s8") == "w7-u8s8"
    with pytest.raises(ConfigError, match="weight form must be one of"):
        isa.resolve_weight_form("int4")


def test_an_npu_resolves_auto_to_its_own_8_bit_form_on_any_cpu():
    assert isa.resolve_weight_form(None, "qnn") == isa.resolve_weight_form("auto", "qnn") == isa.FORM_NPU
    assert isa.resolve_weight_form("w8-u8s8", "qnn") == "w8-u8s8"  # forced: the NPU's kernels, no VNNI warning
    with pytest.raises(ConfigError, match="weight form must be one of"):
        isa.resolve_weight_form("int4", "qnn")
    with pytest.raises(ConfigError, match="provider kind"):
        isa.resolve_weight_form(None, "gpu")


@pytest.mark.parametrize("flags, form, want", [
    ({"avx512_vnni"}, "w8-u8u8", "w8-u8s8"),  # the same 8-bit weights, VNNI's faster exact kernel
    ({"avx512_vnni"}, "w8-u8s8", "w8-u8s8"),
    ({"avx2"}, "w8-u8s8", "w8-u8u8"),  # 8-bit u8·s8 saturates without VNNI: u8·u8 holds the same weights
    ({"avx2"}, "w8-u8u8", "w8-u8u8"),
    ({"avx512_vnni"}, "w7-u8s8", "w7-u8s8"),  # 7-bit weights are other numbers: kept
    ({"avx2"}, "w7-u8s8", "w7-u8s8"),
])
def test_the_cpu_runs_a_plans_weights_in_its_exact_form(flags, form, want):
    assert isa.cpu_form_for(form, frozenset(flags)) == want


def test_this_machine_is_described_by_its_flags():
    m = isa.machine()
    assert set(m["isa"]) <= set(isa.ISA_FLAGS)
    assert isa.has_vnni() == bool(set(isa.VNNI_FLAGS) & cpu_flags())


def test_cli_rejects_an_unknown_weight_form(capsys):
    with pytest.raises(SystemExit):
        main(["run", "hi", "--weight-form", "w4"])
    assert "--weight-form" in capsys.readouterr().err
