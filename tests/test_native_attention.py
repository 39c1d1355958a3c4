"""The BF16 attention kernel (`native.attention`) against an fp64 reference of the same attention (RoPE, causal,
sliding window, a cache continued chunk by chunk), its refusals, and its cached build."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from hetero.config import ModelConfig
from hetero.errors import ConfigError
from hetero.native import attention as native
from hetero.native import build

H, KV, D, CAP = 6, 2, 64, 512


def _cfg(**kw) -> ModelConfig:
    fields = dict(arch="llama", n_layers=1, hidden=H * D, n_heads=H, n_kv_heads=KV, ffn=4 * H * D, vocab=256,
                  context_length=CAP, rms_eps=1e-5, rope_theta=10000.0)
    return ModelConfig(**{**fields, **kw})


def _kernel(cfg: ModelConfig) -> native.Bf16Attention:
    why = native.unavailable(cfg)
    if why is not None:
        pytest.skip(f"the BF16 attention kernel cannot run on this host: {why}")
    return native.Bf16Attention(cfg)


@pytest.fixture(scope="module")
def kernel():
    return _kernel(_cfg())


def _rope_table(n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    ang = np.arange(n)[:, None] / 10000.0 ** (np.arange(0, d, 2) / d)[None]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x [n, heads, d]'s first 2·(table columns) dims at the table rows given (fp64)."""
    h = cos.shape[-1]
    a, b, c, s = x[..., :h], x[..., h : 2 * h], cos[:, None, :], sin[:, None, :]
    return np.concatenate([a * c - b * s, b * c + a * s, x[..., 2 * h :]], -1)


def _norm(x: np.ndarray, w: np.ndarray | None) -> np.ndarray:
    """RMSNorm of each head of x [n, heads, d] (fp64; eps 1e-5, the config's), or x where w is None."""
    return x if w is None else x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w


def _reference(qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, window: int,
               qk_norm: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Every row's causal attention over all rows before it (and itself), in fp64 (QK-norm first where given)."""
    n = qkv.shape[0]
    x = qkv.astype(np.float64)
    qn, kn = qk_norm or (None, None)
    q = _rope(_norm(x[:, : H * D].reshape(n, H, D), qn), cos[:n], sin[:n])
    k = _rope(_norm(x[:, H * D : (H + KV) * D].reshape(n, KV, D), kn), cos[:n], sin[:n])
    v = x[:, (H + KV) * D :].reshape(n, KV, D)
    p = np.arange(n)
    bad = (p[None] > p[:, None]) | ((p[None] <= p[:, None] - window) if window else False)
    out = np.empty((n, H, D))
    for h in range(H):
        s = q[:, h] @ k[:, h // (H // KV)].T / np.sqrt(D)
        s[bad] = -np.inf
        e = np.exp(s - s.max(1, keepdims=True))
        out[:, h] = (e / e.sum(1, keepdims=True)) @ v[:, h // (H // KV)]
    return out.reshape(n, H * D)


@pytest.mark.parametrize("n, chunk, window, qk, rotary", [
    (70, 32, 0, False, D), (300, 128, 0, False, D), (40, 40, 0, False, D), (200, 64, 50, False, D), (17, 8, 5, False, D),
    (150, 64, 0, True, D), (90, 32, 20, True, D), (120, 32, 0, False, 48), (60, 16, 9, True, 16)])
def test_chunked_attention_matches_fp64(n, chunk, window, qk, rotary):
    """qk: a QK-norm model's (Qwen3, Gemma 3) RMSNorm of each q/k head before RoPE, which the kernel computes;
    rotary: the dims of a head RoPE rotates (Phi's partial rotary: the first R)."""
    kernel = _kernel(_cfg(qk_norm=qk, rotary_dim=rotary))
    rng = np.random.default_rng(n + window)
    qkv = rng.standard_normal((n, (H + 2 * KV) * D)).astype(np.float32)
    norms = None
    if qk:  # q/k rows a norm changes, and its weights
        qkv[:, : (H + KV) * D] *= 3.0
        norms = tuple((1 + 0.3 * rng.standard_normal(D)).astype(np.float32) for _ in range(2))
    cos, sin = _rope_table(CAP, rotary)
    kc, vc = np.zeros((KV, CAP, D), np.float32), np.zeros((KV, CAP, D), np.float32)
    out = np.empty((n, H * D), np.float32)
    for s in range(0, n, chunk):  # a prompt continued chunk by chunk over the same cache
        rows = np.ascontiguousarray(qkv[s : s + chunk])
        kernel(rows, kc, vc, s, cos, sin, out[s : s + rows.shape[0]], window, qk_norm=norms)
    want = _reference(qkv, cos, sin, window, norms)
    # bf16 inputs, fp32 sums: ~3e-3 of the largest output (measured 2-5e-3); a wrong mask, rope or norm is O(1)
    assert np.abs(out - want).max() <= 1.5e-2 * np.abs(want).max()
    if qk:  # without the norm: another answer
        assert np.abs(_reference(qkv, cos, sin, window) - want).max() > 0.1 * np.abs(want).max()
    k = _rope(_norm(qkv[:, H * D : (H + KV) * D].reshape(n, KV, D).astype(np.float64), norms and norms[1]),
              cos[:n], sin[:n])
    np.testing.assert_allclose(kc[:, :n].transpose(1, 0, 2), k, rtol=0, atol=1e-5)  # the cache stays fp32
    np.testing.assert_array_equal(vc[:, :n].transpose(1, 0, 2), qkv[:, (H + KV) * D :].reshape(n, KV, D))
    assert not kc[:, n:].any() and not vc[:, n:].any()  # nothing written past the chunk's rows


@pytest.mark.parametrize("block", [D, 16])
def test_rotated_output_is_the_output_times_hadamard(kernel, block):
    """rotate=b: each head's output times diag(H_b, ...), H_b the orthogonal Hadamard matrix (o_in's online transform
    of a rotated model, of a head's size or in blocks), computed on V's rows: the plain output rotated, up to bf16
    rounding."""
    from hetero.outliers.rotate import hadamard

    n = 100
    qkv = np.random.default_rng(7).standard_normal((n, (H + 2 * KV) * D)).astype(np.float32)
    qkv[:, (H + KV) * D :] += 2.0  # a mean in V (kept out of the bf16 rounding, rotated apart)
    cos, sin = _rope_table(CAP, D)
    outs = []
    for rotate in (0, block):
        kc, vc, out = np.zeros((KV, CAP, D), np.float32), np.zeros((KV, CAP, D), np.float32), np.empty((n, H * D), np.float32)
        kernel(qkv, kc, vc, 0, cos, sin, out, rotate=rotate)
        outs.append(out)
    t = np.kron(np.eye(D // block), hadamard(block).numpy())
    want = (outs[0].reshape(n, H, D) @ t).reshape(n, H * D)
    assert np.abs(outs[1] - want).max() <= 1.5e-2 * np.abs(want).max()
    ref = _reference(qkv, cos, sin, 0)
    assert np.abs(outs[0] - ref).max() <= 1.5e-2 * np.abs(ref).max()


def test_refuses_what_it_does_not_take(kernel):
    cos, sin = _rope_table(CAP, D)
    qkv, out = np.zeros((4, (H + 2 * KV) * D), np.float32), np.zeros((4, H * D), np.float32)
    kc = np.zeros((KV, 8, D), np.float32)
    with pytest.raises(ConfigError, match="exceed the cache"):
        kernel(qkv, kc, kc.copy(), 6, cos, sin, out)
    with pytest.raises(ConfigError, match="must be"):
        kernel(qkv[:, :-1], kc, kc.copy(), 0, cos, sin, out)
    with pytest.raises(ConfigError, match="C-contiguous float32"):
        kernel(qkv, kc, kc.copy(), 0, cos, sin, np.zeros((4, 2 * H * D), np.float32)[:, ::2])
    with pytest.raises(ConfigError, match="Hadamard block of 24"):
        kernel(qkv, kc, kc.copy(), 0, cos, sin, out, rotate=24)
    with pytest.raises(ConfigError, match="qk_norm=False"):  # a plain model's attention given QK-norm weights
        kernel(qkv, kc, kc.copy(), 0, cos, sin, out, qk_norm=(np.ones(D, np.float32),) * 2)
    with pytest.raises(ConfigError, match="qk_norm=True"):  # a QK-norm model's without them
        native.Bf16Attention(_cfg(qk_norm=True))(qkv, kc, kc.copy(), 0, cos, sin, out)
    with pytest.raises(ConfigError, match=r"columns 16"):  # a partial rotary model's table has R/2 columns
        native.Bf16Attention(_cfg(rotary_dim=32))(qkv, kc, kc.copy(), 0, cos, sin, out)
    for cfg, what in ((_cfg(head_dim=16, hidden=H * 16), "head size of 16"),):
        assert what in native.config_unsupported(cfg)
        with pytest.raises(ConfigError, match=what):
            native.Bf16Attention(cfg)


def test_a_damaged_build_is_rebuilt(kernel, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    native._library.cache_clear()
    try:
        native._library()
        built = next(tmp_path.glob("native/*/attention_bf16.so"))
        good = built.read_bytes()
        damaged = tmp_path / "damaged.so"  # same size, other content, as a new file (the loaded one stays mapped)
        damaged.write_bytes(good[:-64] + bytes(64))
        os.replace(damaged, built)
        native._library.cache_clear()
        with caplog.at_level(logging.WARNING):
            native._library()
        assert "fails its content hash" in caplog.text and built.read_bytes() == good
    finally:
        native._library.cache_clear()


def test_unavailable_says_why_and_the_layer_graphs_keep_their_attention(monkeypatch):
    """Without AVX-512 BF16 or without a C compiler the kernel is not built; the whole-layer graphs then keep ONNX
    Runtime's GroupQueryAttention, and `attention_kernel` says why."""
    import hetero.cpu
    from hetero.npu.graph_backend import attention_kernel

    monkeypatch.setattr(hetero.cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_vnni"}))
    assert native.unavailable(_cfg()) == "this CPU lacks avx512bw, avx512vl, avx512_bf16"
    kernel, why = attention_kernel(_cfg(), "auto")
    assert kernel is None and "GroupQueryAttention" in why and "avx512_bf16" in why
    with pytest.raises(ConfigError, match="cannot run here: this CPU lacks"):
        attention_kernel(_cfg(), "bf16")
    monkeypatch.undo()
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    if not any(f not in hetero.cpu.cpu_flags() for f in native.NEEDS):
        assert native.unavailable(_cfg()) == "no C compiler (gcc or cc, or $CC) to build the kernel with"


def test_the_bench_times_both_kernels_on_the_same_rows(kernel):
    """`bench/attention_kernel.py`'s measurement: both kernels' outputs against its fp64 reference."""
    from bench.attention_kernel import measure

    row = measure(_cfg(), 40, 24, repeats=1)
    assert row["gqa"]["rel_max_err"] < 1e-5 and row["bf16"]["rel_max_err"] < 1.5e-2
    assert row["gqa"]["ms"] > 0 and row["bf16"]["ms"] > 0


_THREADS_CHILD = """
import os, sys, threading
import numpy as np
sys.path.insert(0, sys.argv[1])
import test_native_attention as T

kernel = T._kernel(T._cfg())
n, cap = 64, 4096
rng = np.random.default_rng(0)
qkv = rng.standard_normal((n, (T.H + 2 * T.KV) * T.D), dtype=np.float32)
k, v = np.zeros((T.KV, cap, T.D), np.float32), np.zeros((T.KV, cap, T.D), np.float32)
cos, sin = T._rope_table(cap, T.D)
out = np.empty((n, T.H * T.D), np.float32)


def once():  # rows at the end of a 4096-key cache: scratch for 4096 keys, ~3 MB
    kernel(qkv, k, v, cap - n, cos, sin, out)


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def threads(count):
    for _ in range(count):
        t = threading.Thread(target=once)
        t.start()
        t.join()


threads(20)  # more threads than glibc keeps arenas (8 per core): its own pools settle
before = rss_mb()
threads(60)
print(rss_mb() - before)
"""


def test_a_threads_scratch_is_freed_when_it_exits(kernel):
    """A prefill's second lane is a new thread each time; each grows the kernel's scratch (~1 MB per KV head at 2048
    keys) and must give it back when it exits, or a long-lived process grows with every prefill.

    Measured in a process of its own: inside the suite's process (3.4 GB by then) other tests' pools move its RSS by
    tens of MB. Alone, 60 threads move it by ~5 MB; a leak would keep 60 x ~3 MB."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _THREADS_CHILD, os.path.dirname(__file__)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    kept = float(run.stdout.split()[-1])
    assert kept < 40, f"{kept:.0f} MB kept by 60 exited threads"
