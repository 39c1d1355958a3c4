"""The CPU lane's prefill attention (ORT GroupQueryAttention) against the float reference `model.attention`."""

import numpy as np
import pytest
import torch

from hetero import model as ref
from hetero.attention import ChunkAttention
from hetero.errors import ConfigError
from tests.conftest import make_tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("threads", [1, 2])
def test_chunks_equal_reference_attention_and_write_only_real_rows(arch: str, threads: int) -> None:
    cfg = make_tiny_model(arch).config
    rope = ref.RopeTable(cfg, 96)
    attend = ChunkAttention(cfg, rope.cos, rope.sin, threads)
    gen = torch.Generator().manual_seed(0)
    shape = (cfg.n_kv_heads, 80, cfg.head_dim)
    kc, vc = torch.zeros(shape), torch.zeros(shape)  # the reference's cache
    kc2, vc2 = torch.full(shape, 7.0), torch.full(shape, 7.0)  # ours: rows never written stay 7
    qd, kd = cfg.q_dim, cfg.kv_dim
    for start, n in ((0, 16), (16, 16), (32, 5)):  # the last chunk: 5 real rows of 16
        qkv = torch.randn(16, qd + 2 * kd, generator=gen)
        with torch.inference_mode():
            want = ref.attention(cfg, qkv[:, :qd], qkv[:, qd:qd + kd], qkv[:, qd + kd:], rope, kc, vc, start, n)
        out = torch.zeros(n, qd)  # numpy views of these torch buffers: the attention writes through them
        got = attend(qkv[:n].contiguous().numpy(), kc2.numpy(), vc2.numpy(), start, out.numpy())
        assert got.ctypes.data == out.data_ptr()  # the result is the `out` buffer
        torch.testing.assert_close(out, want[:n], atol=2e-6, rtol=1e-5)
        end = start + n
        torch.testing.assert_close(kc2[:, :end], kc[:, :end], atol=2e-6, rtol=1e-5)
        assert np.array_equal(vc2[:, :end], vc[:, :end])  # V is copied, not computed
        assert (kc2[:, end:] == 7).all() and (vc2[:, end:] == 7).all()  # nothing past the real rows


def test_bad_buffers_and_positions_raise_config_errors() -> None:
    cfg = make_tiny_model().config
    rope = ref.RopeTable(cfg, 32)
    attend = ChunkAttention(cfg, rope.cos, rope.sin, 1)
    kc = torch.zeros(cfg.n_kv_heads, 24, cfg.head_dim)
    qkv = torch.zeros(8, cfg.q_dim + 2 * cfg.kv_dim)
    with pytest.raises(ConfigError, match="exceed the cache"):
        attend(qkv.numpy(), kc.numpy(), kc.clone().numpy(), 20, np.zeros((8, cfg.q_dim), np.float32))
    with pytest.raises(ConfigError, match="contiguous float32"):
        attend(np.zeros((cfg.q_dim + 2 * cfg.kv_dim, 8), np.float32).T, kc.numpy(), kc.clone().numpy(), 0,
               np.zeros((8, cfg.q_dim), np.float32))
    with pytest.raises(ConfigError, match="contiguous float32"):
        attend(qkv.numpy().astype(np.float64), kc.numpy(), kc.clone().numpy(), 0, np.zeros((8, cfg.q_dim), np.float32))
    with pytest.raises(ConfigError, match="threads"):
        ChunkAttention(cfg, rope.cos, rope.sin, 0)


def test_a_call_uses_the_lanes_thread_share() -> None:
    from hetero.threads import torch_threads

    cfg = make_tiny_model().config
    rope = ref.RopeTable(cfg, 32)
    attend = ChunkAttention(cfg, rope.cos, rope.sin, 2)
    kc = np.zeros((cfg.n_kv_heads, 24, cfg.head_dim), np.float32)
    qkv = np.random.default_rng(1).standard_normal((8, cfg.q_dim + 2 * cfg.kv_dim), dtype=np.float32)
    outs = []
    for n in (1, 2, 4):  # a lane sharing the cores, one alone, and more than the attention may take
        with torch_threads(n):
            outs.append(attend(qkv, kc.copy(), kc.copy(), 0, np.zeros((8, cfg.q_dim), np.float32)))
    assert sorted(attend._sessions) == [(1, 0), (2, 0)]  # capped at its `threads` (keyed by threads, window)
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[1], outs[2])  # heads split across threads, same math
