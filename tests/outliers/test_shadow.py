"""Eq. 1 decomposition and the INT8 exactness of the reference backend (hetero/outliers/shadow.py)."""

from __future__ import annotations

import numpy as np
import torch

from hetero.model import forward
from hetero.weights import SITES
from hetero.outliers.plan import SiteQuant, plan_from_scales
from hetero.outliers.quantize import int8_linear, int8_matmul, quantize_act, quantize_weight
from hetero.outliers.shadow import QuantizedBackend, int8_acc, npu_part, quantize_act_torch, shadow_part, split_outliers


def _x(t=33, n=1536, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, generator=g)
    x[:, [c for c in (7, 300, 1200) if c < n]] *= 80.0  # outlier channels
    return x


def test_int8_acc_equals_int8_matmul_bit_for_bit():
    x = _x()
    w = quantize_weight(np.random.default_rng(0).standard_normal((96, 1536)).astype(np.float32))
    u8 = quantize_act(x.numpy(), 0.02)
    ref = int8_matmul(u8, w)
    q = torch.from_numpy(u8.astype(np.float32) - 128)
    got = int8_acc(q, torch.from_numpy(w.q.astype(np.float32)))
    assert np.array_equal(got.numpy().astype(np.int64), ref.astype(np.int64))
    # extreme case: all activations -128 and all weights 127 (|acc| = 128·127·1536 > 2^24)
    q = torch.full((2, 1536), -128.0)
    wq = torch.full((3, 1536), 127.0)
    assert float(int8_acc(q, wq)[0, 0]) == -128 * 127 * 1536


def test_npu_part_equals_int8_linear_bit_for_bit():
    x = _x(n=576)
    rng = np.random.default_rng(1)
    ws = [quantize_weight(rng.standard_normal((o, 576)).astype(np.float32) * 0.05) for o in (64, 32)]
    b = torch.randn(64)
    got = npu_part(x, 0.017, ws, [b, None])
    assert np.array_equal(got[0].numpy(), int8_linear(x.numpy(), 0.017, ws[0], b.numpy()))
    assert np.array_equal(got[1].numpy(), int8_linear(x.numpy(), 0.017, ws[1]))
    assert np.array_equal(quantize_act_torch(x, 0.017).numpy() + 128, quantize_act(x.numpy(), 0.017))


def test_eq1_npu_part_plus_shadow_is_unclipped_quantized_matmul():
    x, s = _x(n=576), 0.02
    w = quantize_weight(np.random.default_rng(2).standard_normal((48, 576)).astype(np.float32) * 0.05)
    w_deq = torch.from_numpy(w.dequantize())
    (npu,) = npu_part(x, s, [w])
    sq = SiteQuant(s, (7, 300), 1)
    shadow = shadow_part(x, sq, w_deq.T.contiguous())
    # x quantized without clipping: the grid inside [-128 s, 127 s], exact beyond (Eq. 1)
    inside = (x >= -128 * s) & (x <= 127 * s)
    x_hat = torch.where(inside, torch.round(x / s) * s, x)
    want = (x_hat.double() @ w_deq.double().T).float()
    torch.testing.assert_close(npu + shadow, want, rtol=1e-5, atol=1e-3)
    # and far closer to the float matmul than the clipped NPU part alone
    exact = x @ w_deq.T
    assert (npu + shadow - exact).abs().max() < 0.05 * (npu - exact).abs().max()


def test_split_outliers_is_compact():
    x, s = _x(n=576), 0.02
    ch, r = split_outliers(x, s)
    assert set(ch.tolist()) <= {7, 300} | set(torch.nonzero((x.abs() > 127 * s).any(0)).flatten().tolist())
    assert r.shape == (x.shape[0], ch.numel())
    torch.testing.assert_close(x.clamp(-128 * s, 127 * s)[:, ch] + r, x[:, ch])


def test_pruned_site_has_no_shadow():
    assert shadow_part(_x(n=64), SiteQuant(0.02), torch.zeros(64, 8)) is None


def test_backend_close_to_float_and_shadow_helps(tiny, ids):
    cfg, w = tiny.config, tiny.weights
    ref_logits, _, _ = forward(cfg, w, ids)
    from hetero.outliers.calibration import run_sites

    amax = {}
    run_sites(cfg, w, ids, lambda l, s, x: amax.__setitem__((l, s), float(x.abs().max())))
    small = {k: v / 127 / 8 for k, v in amax.items()}  # clip at 1/8 of absmax: many outliers
    clipped = QuantizedBackend(cfg, w, plan_from_scales(tiny, small))
    shadow = QuantizedBackend(cfg, w, plan_from_scales(tiny, small, {k: (0,) for k in small}))
    err_clip = (forward(cfg, w, ids, backend=clipped)[0] - ref_logits).abs().mean()
    err_shadow = (forward(cfg, w, ids, backend=shadow)[0] - ref_logits).abs().mean()
    assert err_shadow < 0.5 * err_clip
    assert set(k[1] for k in small) == set(SITES)


def test_per_channel_weights_bit_exact():
    from hetero.outliers.quantize import int8_linear_per_channel, quantize_weight_per_channel

    x = _x(n=1536)
    w = quantize_weight_per_channel(np.random.default_rng(3).standard_normal((40, 1536)).astype(np.float32))
    (got,) = npu_part(x, 0.03, [w])
    assert np.array_equal(got.numpy(), int8_linear_per_channel(x.numpy(), 0.03, w))
