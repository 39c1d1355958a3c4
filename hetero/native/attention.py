"""A chunk's causal attention in BF16 dot products on the CPU (AVX-512 BF16), compiled here from C.

mllm-NPU §3.1 keeps attention in float on the CPU; on a long prompt it is most of a prefill (ONNX Runtime's fp32
GroupQueryAttention: 41% of 1024 tokens, 52% of 2048, docs/journal.md). A CPU with AVX-512 BF16 multiplies bf16
pairs at twice the fp32 FMA's rate, and no library here gives one attention call that uses it (ONNX Runtime's
CPU kernels are fp32; torch's bf16 SDPA ran 35–55 GFLOP/s, its matmuls with a separate softmax lost on casts and
thread wake-ups; OpenVINO's own SDPA became a generic subgraph: journal, "Issue 24"). `attention_bf16.c` is one:
a flash attention (online softmax, Dao et al.) over the fp32 KV cache with Q, K, V and the probabilities rounded
to bf16 and every sum in fp32, as OpenVINO runs its own attention on such CPUs. One call does what the
GroupQueryAttention node of a whole-layer graph does (`attention.gqa_node`), and a QK-norm model's RMSNorm of each
q/k head before it (Qwen3, Gemma 3; the node needs it done beside it): RoPE (rotate-half) of the chunk's q/k rows
from the layer's table (a windowed layer's own base, Gemma 3), their K/V written into the cache rows in place,
causal attention (and a sliding window) over the cache. On one thread (a wavefront lane, `sched.wavefront`) it
measured 2.1–3.0× GroupQueryAttention's speed (`bench/results/attention_kernel.md`: 0.05 vs 0.12 ms at 32 rows,
7.4 vs 15.8 ms at 256 rows over 2048 keys; relative error 2–5e-3 against fp64); its dot products then run at ~0.9 per cycle, the rest is softmax, masks and repacking.

Two exact rewrites keep bf16's error small: K and V lose a reference row before rounding (SageAttention's smoothing
of K; softmax ignores a score shift common to a query's keys, and the probabilities sum to one, so the V reference
is added back exactly), and the softmax's row sums add the probabilities as rounded, the ones PV multiplies (the
output stays a convex combination of V's rows). The reference is position 0's K and V, which every chunk of a
prompt sees: a query's result depends only on its keys, not on where its chunk ends, so the prefill is the same
however a prompt is cut (the mean over the chunk's keys, used before, was not). The default's perplexity
through the prefill: +0.19% of float's (fp32 GroupQueryAttention: -0.05%; budget +0.5%; docs/journal.md). And a rotated model's online Hadamard of o_in (QuaRot), one head's size,
(or its blocks of 16 to 64) is applied to V's rows here (`rotate`) instead of to the output in the graph:
o·H = Σ p (v·H).

The kernel is compiled once per host with the host's C compiler (`CC`, else gcc or cc) into the user cache,
keyed by its source and flags, and verified by content hash before each process loads it (`build.Kernel`).
Where it cannot run (no AVX-512 BF16, no compiler, a head it does not take) `unavailable` says why and the
layer graphs keep GroupQueryAttention.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np

from hetero import layerspec
from hetero.buffers import f32_address
from hetero.config import ModelConfig
from hetero.errors import ConfigError
from hetero.native.build import Kernel

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-std=gnu11", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fPIC", "-shared")
NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")  # /proc/cpuinfo flags the kernel's instructions need
MAX_HEAD = 256
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGS = [_P, _I, _I, _P, _P, _I, _I, _I, _P, _P, _I, _P, _I, _I, _I, _I, ctypes.c_float, _I, _I, _P, _P, ctypes.c_float, _I]


def _setup(lib: ctypes.CDLL) -> None:
    lib.hetero_attention_bf16.restype = ctypes.c_int
    lib.hetero_attention_bf16.argtypes = _ARGS


KERNEL = Kernel("attention_bf16.c", FLAGS, NEEDS, "the BF16 attention kernel", _setup)
SOURCE = KERNEL.path
__all__ = ["Bf16Attention", "KERNEL", "config_unsupported", "rotate_block_ok", "unavailable"]


def config_unsupported(cfg: ModelConfig) -> str | None:
    """What of `cfg`'s attention the kernel does not compute (None: it computes every layer's)."""
    d = cfg.head_dim
    if d % 32 or d > MAX_HEAD:
        return f"a head size of {d} (the kernel takes multiples of 32 up to {MAX_HEAD})"
    if cfg.n_heads % cfg.n_kv_heads:
        return f"{cfg.n_heads} query heads over {cfg.n_kv_heads} KV heads (not a divisor)"
    return layerspec.lacks(layerspec.LayerSpec.of(cfg), "BF16 attention kernel")


def rotate_block_ok(block: int, head_dim: int) -> bool:
    """Whether the kernel applies an online Hadamard of `block` (o_in's, on V's rows) to heads of `head_dim`."""
    return 16 <= block <= head_dim and block & (block - 1) == 0 and head_dim % block == 0


def unavailable(cfg: ModelConfig) -> str | None:
    """None when the BF16 kernel computes `cfg`'s attention on this host, else why not (one line)."""
    from hetero.cpu import cpu_flags

    missing = [f for f in NEEDS if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    lacks = config_unsupported(cfg)
    if lacks:
        return f"this model has {lacks}"
    return KERNEL.unavailable(_library)


@functools.cache
def _library() -> ctypes.CDLL:
    """The compiled kernel (`build.Kernel.load`: built once per host into `<cache>/native/<key>/`, verified)."""
    return KERNEL.load()


class Bf16Attention:
    """`attn(qkv, k_cache, v_cache, start, cos, sin, out, window)`: one chunk's attention (module doc). The caller
    passes the layer's own RoPE table (a windowed layer's local base, Gemma 3) and a QK-norm model's (q_norm, k_norm)."""

    def __init__(self, cfg: ModelConfig):
        why = unavailable(cfg)
        if why is not None:
            raise ConfigError(f"the BF16 attention kernel cannot run here: {why}")
        self.cfg, self._fn = cfg, _library().hetero_attention_bf16

    def __call__(self, qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int, cos: np.ndarray,
                 sin: np.ndarray, out: np.ndarray, window: int = 0, rotate: int = 0,
                 qk_norm: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """qkv [n, q_dim + 2·kv_dim] (the chunk's rows, un-roped) at positions start..start+n-1 relative to the
        cache's row 0; k_cache/v_cache [n_kv, capacity, D] (one layer's); cos/sin [positions, D/2] whose row p is
        position p (R/2 columns: a head's first R = cfg.rotary_dim dims rotate, Phi's partial rotary);
        out [n, q_dim]. Every array C-contiguous float32. Writes the chunk's K/V rows and out.
        rotate: 0, or a block b (a power of two from 16 to D): out is each head's output times diag(H_b, ...) with H_b
        the orthogonal Hadamard matrix of size b (`rotate.hadamard`): the online transform of a rotated model's o_in
        (QuaRot), applied to V's rows instead of to the [n, q_dim] output in the graph.
        qk_norm: the layer's (q_norm, k_norm) weights [D] float32 (QK-norm of each head before RoPE), required exactly
        when the model has QK-norm."""
        cfg, n = self.cfg, qkv.shape[0]
        kv, d = cfg.n_kv_heads, cfg.head_dim
        if qkv.shape[1:] != (cfg.q_dim + 2 * cfg.kv_dim,) or out.shape != (n, cfg.q_dim) or n < 1:
            raise ConfigError(f"attention: qkv {qkv.shape} and out {out.shape} must be [n, {cfg.q_dim + 2 * cfg.kv_dim}]"
                              f" and [n, {cfg.q_dim}] with n >= 1")
        if k_cache.shape != v_cache.shape or k_cache.shape[0] != kv or k_cache.shape[2] != d:
            raise ConfigError(f"attention: the caches {k_cache.shape}, {v_cache.shape} must be [{kv}, capacity, {d}]")
        half = cfg.rotary_dim // 2
        if start < 0 or start + n > min(k_cache.shape[1], cos.shape[0]) or cos.shape != sin.shape \
                or cos.shape[1] != half:
            raise ConfigError(f"attention: rows {start}..{start + n} exceed the cache ({k_cache.shape[1]}) or RoPE "
                              f"table {cos.shape} (columns {half})")
        norms = self.norm_addresses(qk_norm)
        self.at(f32_address(qkv, "attention: qkv"), n, f32_address(k_cache, "attention: k_cache"),
                f32_address(v_cache, "attention: v_cache"), k_cache.shape[1], start, f32_address(cos, "attention: cos"),
                f32_address(sin, "attention: sin"), f32_address(out, "attention: out"), window, rotate, *norms)
        return out

    def norm_addresses(self, qk_norm: tuple[np.ndarray, np.ndarray] | None) -> tuple[int, int]:
        """The addresses of a layer's (q_norm, k_norm) for `at` ((0, 0): none), checked against the model: a QK-norm
        model's attention without them, or a plain one's with them, would be a silently different layer."""
        if (qk_norm is not None) != self.cfg.qk_norm:
            raise ConfigError(f"attention: this model has qk_norm={self.cfg.qk_norm}: pass its layer's (q_norm, k_norm)"
                              f" exactly when it has")
        if qk_norm is None:
            return 0, 0
        d = self.cfg.head_dim
        if any(w.shape != (d,) for w in qk_norm):
            raise ConfigError(f"attention: q_norm and k_norm must be [{d}], got {[w.shape for w in qk_norm]}")
        return f32_address(qk_norm[0], "attention: q_norm"), f32_address(qk_norm[1], "attention: k_norm")

    def at(self, qkv: int, n: int, k_cache: int, v_cache: int, capacity: int, start: int, cos: int, sin: int,
           out: int, window: int = 0, rotate: int = 0, q_norm: int = 0, k_norm: int = 0) -> None:
        """`__call__` on the addresses of buffers laid out as it checks them (a prefill's runtime-owned buffers,
        checked once per prompt: `runtime.PrefillJob`), without checking them again: what Python did per call
        was a tenth of a short prefill's attention time. q_norm/k_norm: `norm_addresses`."""
        cfg = self.cfg
        d = cfg.head_dim
        rc = self._fn(qkv, n, cfg.q_dim + 2 * cfg.kv_dim, k_cache, v_cache, capacity, start, 0, cos, sin,
                      cfg.rotary_dim // 2, out,
                      cfg.q_dim, cfg.n_heads, cfg.n_kv_heads, d, cfg.scale, window, rotate, q_norm or None,
                      k_norm or None, cfg.rms_eps, cfg.rotary_dim)
        if rc == 1:
            raise MemoryError("the BF16 attention kernel could not allocate its scratch buffers")
        if rc != 0:
            raise ConfigError(f"the BF16 attention kernel refused head size {d}, {cfg.n_kv_heads} KV heads"
                              + (f" or a Hadamard block of {rotate} (a power of two from 16 to the head size)"
                                 if rotate else ""))
