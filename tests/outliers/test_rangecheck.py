"""The compiled range checks of a site's input (hetero/outliers/rangecheck.py) against their torch definitions."""

from __future__ import annotations

import numpy as np
import torch

from hetero.outliers.rangecheck import rows_inside, split_beyond
from hetero.outliers.rotate import block_hadamard


def _torch_split(x: torch.Tensor, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    channels = torch.nonzero((x.amin(0) < lo) | (x.amax(0) > hi)).flatten()
    xc = x[:, channels]
    return channels, xc - xc.clamp(lo, hi)


def test_split_beyond_equals_the_torch_split_bit_for_bit():
    rng = np.random.default_rng(0)
    for trial in range(300):
        t, n = int(rng.integers(1, 40)), int(rng.integers(1, 300))
        x = torch.from_numpy(rng.standard_normal((t, n)).astype(np.float32))
        s = float(rng.uniform(0.005, 0.03))
        lo, hi = -128 * s, 127 * s
        if trial % 3 == 0:  # values on the float32 bounds and just past them
            x[0, 0], x[-1, -1] = float(np.float32(lo)), float(np.float32(hi))
            x[0, -1] = float(np.nextafter(np.float32(hi), np.float32(10)))
        want, got = _torch_split(x, lo, hi), split_beyond(x, lo, hi)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_split_beyond_of_a_row_inside_is_empty():
    channels, r = split_beyond(torch.zeros(2, 64), -1.0, 1.0)
    assert channels.numel() == 0 and r.shape == (2, 0)


def test_rows_inside_never_passes_a_row_the_torch_transform_puts_beyond():
    """Conservative by construction (a margin for the transform's rounding): checked near the bounds, where the
    two ways' roundings could disagree."""
    rng = np.random.default_rng(1)
    passed = 0
    for _ in range(400):
        x = torch.from_numpy(rng.standard_normal((4, 576)).astype(np.float32)) * float(rng.uniform(0.1, 2.0))
        xt = block_hadamard(x, 64)
        hi = float(xt.abs().amax()) * float(rng.uniform(0.98, 1.02))  # the bound near the largest value
        inside = rows_inside(x, -hi, hi, 64)
        for r in range(4):
            if inside[r]:
                passed += 1
                assert float(xt[r].abs().amax()) <= hi
    assert passed > 0  # the check does pass rows, not only refuse them


def test_rows_inside_without_transform_is_exact_and_refuses_nan():
    x = torch.tensor([[0.5, -1.0], [1.0, 0.0], [1.0000001, 0.0], [float("nan"), 0.0]])
    assert rows_inside(x, -1.0, 1.0, None).tolist() == [True, True, False, False]
    assert rows_inside(torch.full((1, 64), float("nan")), -1.0, 1.0, 64).tolist() == [False]
