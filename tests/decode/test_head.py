"""The INT8 LM head (hetero/decode/head.py): its norm, compiled quantization and rescaling equal the formulas."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from hetero import model as ref
from hetero.decode.twocore.attnpool import AttentionPool
from hetero.decode.head import Int8Head, int8_head_graph
from tests.conftest import make_tiny_model


@pytest.mark.parametrize("helper", [False, True])
def test_int8_head_equals_the_formula_for_every_row_count(helper):
    """Python API sessions without a helper thread, C API sessions beside one (its halves at once in a step). Its
    final RMSNorm is the float reference's (`model.rms_norm`) to float32 rounding, in numpy."""
    m = make_tiny_model()
    cfg = m.config
    pool = AttentionPool() if helper else None
    head = Int8Head(cfg, m.arrays(), threads=1, pool=pool)
    g = torch.Generator().manual_seed(0)
    f32 = np.float32
    for rows in (1, 2, 4, 8, 1):  # the bound buffers of a row count are reused
        h = torch.randn(rows, cfg.hidden, generator=g) * (rows + 0.5)
        hn = h.numpy()
        ms = np.mean(hn * hn, -1, keepdims=True, dtype=f32)
        x = hn * (f32(1) / np.sqrt(ms + f32(cfg.rms_eps))) * m.arrays()["norm"]
        torch.testing.assert_close(torch.from_numpy(x), ref.rms_norm(h, m.weights.norm, cfg.rms_eps))
        x = torch.from_numpy(x)
        s = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
        xq = (torch.round(x / s).clamp(-127, 127) + 128).to(torch.uint8).numpy()
        acc = np.concatenate([ort.InferenceSession(int8_head_graph(m.weights.lm_head[lo:hi])[0].SerializeToString(),
                                                   providers=["CPUExecutionProvider"]).run(None, {"x_q": xq})[0]
                              for lo, hi in head.parts], axis=1)
        want = torch.from_numpy(acc).float() * s * torch.from_numpy(head.w_scale)
        got = head(hn)
        assert isinstance(got, np.ndarray) and np.array_equal(got, want.numpy())
        assert not np.shares_memory(got, head(hn))  # each call returns its own logits
    if pool is not None:
        pool.close()


def test_the_head_quantized_a_block_of_rows_at_a_time_is_the_whole_heads_formula():
    """`quantize_head` reads the head `loader.GGUF_ROWS` vocabulary rows at a time (a 1B head is 1 GB of float32):
    across block edges, and from a torch tensor, it is the whole-matrix formula bit for bit."""
    from hetero.decode.head import quantize_head
    from hetero.loader import GGUF_ROWS
    from hetero.outliers.quantize import W_QMAX_U8S8

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((2 * GGUF_ROWS + 37, 24)) * rng.uniform(0.1, 3, (2 * GGUF_ROWS + 37, 1))).astype(np.float32)
    w[5] = 0  # a zero row: its scale is the floor, its values 0
    wt = w.T
    scale = np.maximum(np.abs(wt).max(axis=0), 1e-12) / W_QMAX_U8S8
    want = np.clip(np.round(wt / scale), -W_QMAX_U8S8, W_QMAX_U8S8).astype(np.int8)
    for given in (w, torch.from_numpy(w)):
        wq, s = quantize_head(given)
        assert wq.shape == want.shape and np.array_equal(wq, want) and np.array_equal(s, scale)
        assert s.dtype == np.float32 and wq.dtype == np.int8
