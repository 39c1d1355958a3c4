"""KV block compression (LLMS §3.2) and the disk tier's block files, on numpy K/V."""

from __future__ import annotations

import numpy as np
import pytest

from hetero.serve.disk import DiskTier, compressed_payload, float_payload, payload_kv, read_block
from hetero.serve.quant import attention_error, compress, dequantize, quantize


def kv(seed: int = 0, shape: tuple[int, ...] = (2, 3, 16, 8)) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    return (g.standard_normal(shape) * 2).astype(np.float32), g.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("level, qmax, width", [("int8", 255, 8), ("int4", 15, 4)])
def test_quantize_is_channelwise_within_half_a_step(level: str, qmax: int, width: int) -> None:
    k, _ = kv()
    q = quantize(k, level)
    assert q.codes.dtype == np.uint8 and q.codes.shape == (2, 3, 16, width) and q.lo.dtype == np.float16
    assert q.nbytes == q.codes.nbytes + 2 * (2 * 3 * 1 * 8) * 2  # codes + float16 min and scale per channel
    back = dequantize(q)
    assert back.dtype == np.float32 and back.shape == k.shape
    step = q.scale.astype(np.float32)
    # every value within half a step of its channel's grid (plus the float16 rounding of the channel's minimum)
    assert (np.abs(back - k) <= 0.5 * step + np.abs(k.min(axis=2, keepdims=True) - q.lo) + 1e-5).all()
    # each channel's extremes are on the grid's ends
    codes = np.rint((back - q.lo.astype(np.float32)) / step)
    assert codes.min(axis=2).max() == 0 and codes.max(axis=2).min() == qmax


def test_int4_packs_two_codes_a_byte() -> None:
    x = np.zeros((1, 1, 2, 4), np.float32)
    x[0, 0, 1] = [15, 0, 15, 0]  # per channel: min 0, max 15 or 0 → codes 15/0
    q = quantize(x, "int4")
    assert q.codes[0, 0, 1].tolist() == [15, 15] and q.codes[0, 0, 0].tolist() == [0, 0]
    np.testing.assert_allclose(dequantize(q), x, atol=1e-3)


def test_compress_picks_the_fewest_bits_within_tolerance() -> None:
    k, v = kv(1)
    e4 = attention_error(k, v, dequantize(quantize(k, "int4")), dequantize(quantize(v, "int4")))
    e8 = attention_error(k, v, dequantize(quantize(k, "int8")), dequantize(quantize(v, "int8")))
    assert 0 < e8 < e4
    assert compress(k, v, tolerance=e4 * 1.01)[0].level == "int4"
    qk, qv, err = compress(k, v, tolerance=e4 * 0.99)
    assert (qk.level, qv.level) == ("int8", "int8") and err == pytest.approx(e8)
    assert compress(k, v, tolerance=0.0)[0].level == "int8"  # none within: the most bits
    assert attention_error(k, v, k, v) == 0.0


def test_disk_blocks_round_trip_exactly(tmp_path) -> None:
    k, v = kv(2)
    qk, qv, _ = compress(k, v, tolerance=1.0)
    tier = DiskTier(tmp_path)
    try:
        for uid, payload, want in [(1, float_payload(k, v), (k, v)),
                                   (2, compressed_payload(qk, qv), (dequantize(qk), dequantize(qv)))]:
            path, size, _ = tier.write(uid, payload)
            assert path.parent == tier.dir and size == path.stat().st_size
            got, nbytes, _ = tier.submit_read(path).result()
            assert nbytes == size
            for a, b in zip(payload_kv(got), want):
                assert a.dtype == np.float32
                np.testing.assert_array_equal(a, b)
        got = read_block(tier.path(2))[0]["q"][0]
        assert (got.level, got.shape) == (qk.level, qk.shape)
        np.testing.assert_array_equal(got.codes, qk.codes)
    finally:
        tier.close()
    assert not tier.dir.exists()


def test_an_odd_head_dimension_compresses_to_int8() -> None:
    k, v = kv(3, (1, 2, 8, 5))
    with pytest.raises(ValueError, match="even"):
        quantize(k, "int4")
    qk, qv, err = compress(k, v, tolerance=float("inf"))
    assert (qk.level, qv.level) == ("int8", "int8") and dequantize(qk).shape == k.shape and err < 0.05
