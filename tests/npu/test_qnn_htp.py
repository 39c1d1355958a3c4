"""One layer on the QNN HTP simulator (onnxruntime-qnn wheel) within one quantization step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime_qnn")

from hetero.npu.graph_backend import NpuBackend  # noqa: E402
from hetero.npu.providers import QnnHtpProvider  # noqa: E402
from hetero.outliers.shadow import QuantizedBackend  # noqa: E402
from tests.npu.conftest import SHADOWS, tiny_plan  # noqa: E402


def _step(t) -> float:
    """One INT8 quantization step of a tensor at its own per-tensor scale: absmax / 127."""
    return float(t.abs().max()) / 127


@pytest.mark.slow
@pytest.mark.parametrize("shadow", [None, SHADOWS], ids=["plain", "shadows"])
def test_tiny_layer_on_htp_within_one_step(tiny, shadow):
    # HTP computes the float ops (RMSNorm, SiLU) and the dequantized MatMul in its own precision, so
    # outputs differ from the reference by rounding, bounded by one output quantization step.
    plan = tiny_plan(tiny, shadow)
    be = NpuBackend(tiny, plan, 16, provider=QnnHtpProvider())
    ref = QuantizedBackend(tiny.config, tiny.weights, plan)
    g = torch.Generator().manual_seed(0)
    h, a = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g) * 0.5
    for layer in range(2):
        for got, want in zip(be.qkv(layer, h.numpy()), ref.qkv(layer, h)):  # the backend on numpy, the reference torch
            assert float((torch.from_numpy(got) - want).abs().max()) <= _step(want)
        want = ref.o_ffn(layer, a, h)
        assert float((torch.from_numpy(be.o_ffn(layer, a.numpy(), h.numpy())) - want).abs().max()) <= _step(want)


@pytest.mark.slow
def test_htp_context_binary_is_cached_beside_its_model(tiny):
    # embed mode 0: the context binary is its own file, listed (size + sha256) in the entry's meta.json
    import json

    from hetero.npu.cache import graphs_root
    from hetero.npu.providers import QNN_CONTEXT_BIN

    plan = tiny_plan(tiny)
    first = NpuBackend(tiny, plan, 16, provider=QnnHtpProvider(), layers=[0])
    again = NpuBackend(tiny, plan, 16, provider=QnnHtpProvider(), layers=[0])
    assert not any(r[3] for r in first.report.rows) and again.report.all_cached
    for entry in (graphs_root() / "qnn-htp").iterdir():
        assert QNN_CONTEXT_BIN in json.loads((entry / "meta.json").read_text())["files"]
    h = np.random.default_rng(0).standard_normal((16, 64), dtype=np.float32)
    np.testing.assert_array_equal(first.qkv(0, h)[0], again.qkv(0, h)[0])


def test_a_soc_model_is_its_own_lane(monkeypatch):
    # another HTP: its own graph cache folder and its own recorded equivalent shapes
    monkeypatch.delenv("HETERO_QNN_OPTIONS", raising=False)
    assert QnnHtpProvider().name == "qnn-htp"
    assert QnnHtpProvider({"soc_model": "60"}).name == "qnn-htp-soc60"
    monkeypatch.setenv("HETERO_QNN_OPTIONS", "soc_model=69")
    provider = QnnHtpProvider()
    assert provider.name == "qnn-htp-soc69" and provider.options_key()["soc_model"] == "69"
    assert provider.flavor == "qnn-fp16"
