"""NPU memory budget (§4): FFN graphs first, then QKV, the rest INT8 on the CPU."""

from __future__ import annotations

import torch

from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.npu.placement import graph_weight_bytes, place
from tests.npu.conftest import tiny_plan


def test_ffn_first_then_qkv(tiny):
    cfg = tiny.config
    ffn, qkv = graph_weight_bytes(cfg, "o_ffn"), graph_weight_bytes(cfg, "qkv")
    p = place(cfg, 2 * ffn + qkv)
    assert [p.device_of(layer, "o_ffn") for layer in range(2)] == ["npu", "npu"]
    assert [p.device_of(layer, "qkv") for layer in range(2)] == ["npu", "cpu"]
    assert all(d.reason for d in p.decisions) and p.npu_bytes == 2 * ffn + qkv
    assert all(d.device == "cpu" for d in place(cfg, 0).decisions)
    assert all(d.device == "npu" for d in place(cfg, None).decisions)


def test_backend_follows_placement(tiny):
    p = place(tiny.config, graph_weight_bytes(tiny.config, "o_ffn"))
    be = NpuBackend(tiny, tiny_plan(tiny), 16, provider="cpu", options=GraphOptions(placement=p))
    assert be.program(0).runs[1].graph.device == "cpu"  # the CPU provider serves both (no QNN here)
    h = torch.randn(16, 64)
    assert be.qkv(1, h)[0].shape == (16, 64)
