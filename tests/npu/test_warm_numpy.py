"""A warm INT8 start without torch (its import is ~0.9 s): the default path's NPU modules import no torch, and a
backend whose graphs are cached reads the model's float weights only as numpy (`loader.Model.arrays`), never
`Model.weights`."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hetero.config import ModelConfig
from hetero.errors import ConfigError
from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.npu.nbits import NbitsBackend
from hetero.npu.providers import OrtCpuProvider
from hetero.rope import RopeTable
from tests.npu.conftest import SHADOWS, tiny_plan


def test_the_npu_modules_of_a_warm_start_import_no_torch():
    modules = ["graph_backend", "nbits", "placement", "program", "providers", "segments", "shapes", "quickplan",
               "naive"]
    code = (f"import sys\nfor m in {modules}: __import__('hetero.npu.' + m)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _untouchable(model):
    """`model` whose float weights (torch) fail on first use; its numpy arrays at rest stay readable."""
    arrays = model.arrays()

    def weights():
        raise AssertionError("a warm start touched Model.weights (torch)")

    return model.with_weights(weights, lambda: arrays)


def _layer_inputs(cfg: ModelConfig, n: int, cap: int, seed: int):
    g = np.random.default_rng(seed)
    h = g.standard_normal((n, cfg.hidden), dtype=np.float32)
    kv = [g.standard_normal((cfg.n_kv_heads, cap, cfg.head_dim), dtype=np.float32) for _ in range(2)]
    return h, kv


def test_a_warm_fused_backend_reads_only_numpy_weights(tiny):
    plan = tiny_plan(tiny, SHADOWS, scale=0.03)
    cold = NpuBackend(tiny, plan, 16, options=GraphOptions(fused=True))  # builds the graphs from the weights
    warm = NpuBackend(_untouchable(tiny), plan, 16, options=GraphOptions(fused=True))
    assert warm.report.all_cached and warm.tensors == cold.tensors == "numpy"
    rope, cfg = RopeTable(tiny.config, 64), tiny.config
    for layer in range(cfg.n_layers):
        h, (k, v) = _layer_inputs(cfg, 5, 32, layer)
        outs = []
        for be in (cold, warm):
            kc, vc, out = k.copy(), v.copy(), np.empty_like(h)
            assert be.layer(layer, h, kc, vc, 3, (rope.cos, rope.sin), out) is out
            outs.append((out, kc, vc))
        for got, want in zip(*outs):  # the same graphs: bit for bit, K/V written in place at rows 3..7
            np.testing.assert_array_equal(got, want)
        assert not np.array_equal(outs[0][1][:, 3:8], k[:, 3:8]) and np.array_equal(outs[0][1][:, 8:], k[:, 8:])


def test_a_warm_segmented_backend_without_shadows_reads_only_numpy_weights(tiny):
    """Segments with no shadow site never make the torch reference: qkv/o_ffn on numpy, `Model.weights` untouched."""
    plan = tiny_plan(tiny, scale=0.03)
    cold, warm = NpuBackend(tiny, plan, 16), NpuBackend(_untouchable(tiny), plan, 16)
    assert warm.report.all_cached
    g = np.random.default_rng(0)
    h, a = g.standard_normal((16, 64), dtype=np.float32), g.standard_normal((16, 64), dtype=np.float32)
    for layer in range(2):
        for x, y in zip(warm.qkv(layer, h), cold.qkv(layer, h)):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(warm.o_ffn(layer, a, h), cold.o_ffn(layer, a, h))
    with pytest.raises(ConfigError, match="C-contiguous float32"):  # a caller's output buffer must be one
        warm.o_ffn(0, a, h, out=np.empty((16, 64), np.float64))


def test_warm_nbits_graphs_read_no_float_weights(tiny):
    cold = NbitsBackend(tiny, {}, OrtCpuProvider(1))
    warm = NbitsBackend(_untouchable(tiny), {}, OrtCpuProvider(1))
    assert all(i.cached for i in warm.report) and warm.tensors == "numpy"
    h = np.random.default_rng(1).standard_normal((3, 64), dtype=np.float32)
    for layer in range(2):
        np.testing.assert_array_equal(warm.qkv(layer, h)[0], cold.qkv(layer, h)[0])
