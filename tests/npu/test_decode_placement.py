"""Decode placement: decode steps run on the CPU, as in mllm-NPU (`placement.decode_placement`).

A prefill on an NPU provider (QNN HTP, the simulator on x86) decodes on the ONNX Runtime CPU EP with the
same plan's INT8 weights, in the form this CPU runs exactly (`isa.cpu_form_for`); bit for bit what a
runtime that prefills on the CPU EP decodes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hetero.torch_backends import FloatBackend
from hetero.decode.step import DecodeStep
from hetero.decode.tree import TokenTree
from hetero.errors import ConfigError
from hetero.weights import SITES
from hetero.npu import isa
from hetero.npu.graph_backend import NpuBackend
from hetero.npu.placement import decode_placement
from hetero.npu.providers import OrtCpuProvider
from hetero.outliers.plan import plan_from_scales
from hetero.runtime import Runtime
from tests.npu.conftest import SHADOWS


def _plan(model, form: str):
    return plan_from_scales(model, {(l, s): 0.02 for l in range(2) for s in SITES}, SHADOWS, weight_form=form)


def test_float_and_cpu_ep_runtimes_decode_on_their_own_engines(tiny):
    assert decode_placement(FloatBackend(tiny.config, tiny.weights)).engine == "torch"
    be = NpuBackend(tiny, _plan(tiny, isa.FORM_AVX2), 16, provider="cpu")
    placed = decode_placement(be)
    assert (placed.device, placed.engine) == ("cpu", "ort-cpu") and placed.reason
    step = DecodeStep(Runtime(tiny, chunk=16, backend=be, decode=placed))
    assert placed.small_rows == 8 and step.backend(1).name == "nbits"  # decode sizes: MatMulNBits (`npu.nbits`)
    int8 = DecodeStep(Runtime(tiny, chunk=16, backend=be, decode=placed), small_rows=0)
    assert int8.backend(1).plan.weight_form == isa.FORM_AVX2  # its own INT8 graphs: the form is the plan's
    with pytest.raises(ConfigError, match="provider must be"):
        be.at_chunk(1, provider="qnn-htp")


def test_the_cpu_form_of_a_plans_weights_computes_the_same_numbers(tiny):
    # the swap `at_chunk` makes for a QNN plan: u8·u8 and this CPU's form of the same 8-bit weights
    plan = _plan(tiny, isa.FORM_NPU)
    a = NpuBackend(tiny, plan, 16, provider="cpu")
    b = NpuBackend(tiny, dataclasses.replace(plan, weight_form=isa.cpu_form_for(plan.weight_form)), 16, provider="cpu")
    g = np.random.default_rng(2)
    h, att = g.standard_normal((16, 64), dtype=np.float32), g.standard_normal((16, 64), dtype=np.float32) * 0.5
    for layer in range(2):
        for x, y in zip(a.qkv(layer, h), b.qkv(layer, h)):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(a.o_ffn(layer, att, h), b.o_ffn(layer, att, h))


@pytest.mark.slow
def test_a_prefill_on_qnn_htp_decodes_on_the_cpu_ep_with_the_same_plan(tiny):
    pytest.importorskip("onnxruntime_qnn")
    from hetero.npu.providers import QnnHtpProvider

    plan = _plan(tiny, isa.FORM_NPU)
    qnn = NpuBackend(tiny, plan, 16, provider=QnnHtpProvider())
    placed = decode_placement(qnn)
    assert (placed.device, placed.engine) == ("cpu", "ort-cpu") and "qnn-htp" in placed.reason
    rt = Runtime(tiny, chunk=16, backend=qnn, decode=placed)
    step = DecodeStep(rt, attention_threads=1, small_rows=0)  # the INT8 graphs at every size
    one = step.backend(1)
    assert isinstance(one.provider, OrtCpuProvider) and one.plan.weight_form == isa.cpu_form_for(isa.FORM_NPU)
    # what a runtime prefilling on the CPU EP with this plan decodes, bit for bit, from the same cache
    cpu = Runtime(tiny, chunk=16, backend=NpuBackend(tiny, plan, 16, provider="cpu"))
    cache = cpu.prefill(np.arange(1, 12)).cache
    tree = TokenTree.chain([5, 7])
    want = DecodeStep(cpu, attention_threads=1).forward(cache, tree)
    np.testing.assert_array_equal(step.forward(cache, tree), want)
    assert rt.prefill(np.arange(1, 12)).n_tokens == 11  # the prefill itself still runs on the HTP
