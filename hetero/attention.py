"""The CPU lane's prefill attention: ONNX Runtime's GroupQueryAttention over the KV cache, in place.

mllm-NPU §3.1 keeps attention in float on the CPU/GPU; at long prompts it is the critical lane (the NPU
lane waits on it). One `com.microsoft.GroupQueryAttention` node does a chunk's whole `attn` subgraph: it
reads the chunk's packed Q|K|V rows (the `qkv` subgraph's output buffer, no copy), applies RoPE to Q and K
from the runtime's own cos/sin table, writes K/V into the cache rows start..start+n in place (past and
present bound to the same buffer: Transformer-Lite §2.4's preallocated cache) and attends causally over
[0, start+n) without a mask tensor. A call runs on as many ONNX Runtime threads as its lane's torch share
(`sched.executor.LaneWorkers`): one while the NPU lane runs, every core while attention runs alone. Two
lanes' pools asking for every core at once wait on each other's preempted threads (a 1024-token prefill
took 0.57 s or 0.97 s from run to run that way). Measured against `model.attention`: docs/journal.md,
"Measured facts".

Variants (`config.ModelConfig`): the model's softmax scale; a windowed layer's graph sets
`local_window_size` = W (measured: equal to transformers' window of W, a query seeing keys p-W+1..p; W - 1
and W + 1 both differ by O(1)) and its cache rows hold only its window (`KVCache.place`: row 0 holds position
`base`; the node sees base..start+n-1 as its whole past, RoPE read from the table's row `base`), since the node
computes every score of the past and masks the window after (bench/results/window_layout.md);
a layer binds its own cos/sin (Gemma 3's local RoPE base; R/2 columns for partial rotary); QK-norm runs on
the chunk's packed q/k rows in place before the node (it needs no graph change on the NPU lane).

Only real rows go in: the padded rows of a last chunk never reach the cache or the kernel, and their
output rows are left as they are (finite; discarded after the last layer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnxruntime as ort

from hetero import layerspec
from hetero.buffers import f32_address
from hetero.config import ModelConfig
from hetero.errors import ConfigError
from hetero.rope import RopeTable
from hetero.sessions import cpu_session
from hetero.threads import lane_threads


GQA_INPUTS = ("past_key", "past_value", "seqlens_k", "total_len", "cos", "sin")  # beside the packed qkv rows
GQA_OUTPUTS = ("present_key", "present_value")  # beside the attention output; bound to the past buffers


def gqa_node(n_heads: int, n_kv_heads: int, scale: float, window: int, qkv: str, out: str, name: str = "gqa"):
    """The one `GroupQueryAttention` node of a chunk's attention (this module's graph, and the whole-layer graphs of
    `npu.export`): packed q|k|v [1, S, ·] → `out` [1, S, q_dim], RoPE from cos/sin, K/V written into the cache the
    graph inputs `GQA_INPUTS` name and its outputs `GQA_OUTPUTS` return (the same buffers: in place)."""
    from onnx import helper  # onnx only where a graph is built: a warm `hetero run` builds none

    return helper.make_node(
        "GroupQueryAttention", [qkv, "", "", *GQA_INPUTS], [out, *GQA_OUTPUTS], name=name,
        domain="com.microsoft", num_heads=n_heads, kv_num_heads=n_kv_heads, do_rotary=1, rotary_interleaved=0,
        scale=scale, local_window_size=window if window else -1,
    )


def gqa_supported(cfg: ModelConfig) -> str | None:
    """None when one `gqa_node` computes every layer's attention of `cfg`, else what it lacks (such layers run
    `model.attention` or a QK-norm / local RoPE beside it, `ChunkAttention`)."""
    if (cfg.rotary_dim // 2) % 8:
        return f"a rotary width of {cfg.rotary_dim} (GroupQueryAttention rotates a multiple of 16)"
    return layerspec.lacks(layerspec.LayerSpec.of(cfg), "GroupQueryAttention node")


def _graph(cfg: ModelConfig, window: int = 0) -> bytes:
    """One GroupQueryAttention node: packed qkv [1, S, (H + 2·KV)·D], cache [1, KV, capacity, D] in and out."""
    from onnx import TensorProto, helper

    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    d, kv = cfg.head_dim, cfg.n_kv_heads
    node = gqa_node(cfg.n_heads, kv, cfg.scale, window, "qkv", "out")
    cache = [1, kv, "capacity", d]
    graph = helper.make_graph(
        [node], "chunk_attention",
        [helper.make_tensor_value_info("qkv", f, [1, "rows", cfg.q_dim + 2 * cfg.kv_dim]),
         helper.make_tensor_value_info("past_key", f, cache), helper.make_tensor_value_info("past_value", f, cache),
         helper.make_tensor_value_info("seqlens_k", i32, [1]), helper.make_tensor_value_info("total_len", i32, []),
         helper.make_tensor_value_info("cos", f, ["positions", cfg.rotary_dim // 2]),
         helper.make_tensor_value_info("sin", f, ["positions", cfg.rotary_dim // 2])],
        [helper.make_tensor_value_info("out", f, [1, "rows", cfg.q_dim]),
         helper.make_tensor_value_info("present_key", f, cache),
         helper.make_tensor_value_info("present_value", f, cache)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def row_twice(x: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, row: int, out: np.ndarray,
              run: Callable[[np.ndarray, np.ndarray], object]) -> np.ndarray:
    """out[0] = run's first output row on x's one row [1, ·] given twice, at cache row `row` of k_cache/v_cache
    [n_kv, capacity, D] (row + 1 must lie in the cache). One row takes other kernels than a chunk's rows
    (GroupQueryAttention's token-generation path, torch's one-query attention), which sum in another order: a prompt
    whose last piece was one token differed from the same prompt cold. Twice, the row's numbers are those it has in
    any chunk; the copy's K/V, written into cache row row + 1, are put back as they were (padding never reaches
    the cache)."""
    kept = k_cache[:, row + 1].copy(), v_cache[:, row + 1].copy()
    two = np.empty((2, out.shape[-1]), np.float32)
    run(np.ascontiguousarray(np.repeat(x, 2, axis=0)), two)
    k_cache[:, row + 1], v_cache[:, row + 1] = kept
    out[0] = two[0]
    return out


class ChunkAttention:
    """`attn(qkv, k_cache, v_cache, start, out)`: the `attn` subgraph of one prefill chunk (see the module doc).

    cos/sin: the runtime's RoPE table [positions, R/2] (`model.RopeTable`), kept alive and bound once per run;
    local: the (cos, sin) of the windowed layers when they have their own base (`RopeTable.local_cos/sin`).
    qk_norms: per layer, the (q_norm, k_norm) weights [D] of a QK-norm model.
    threads: the most ONNX Runtime intra-op threads a call uses (a call uses torch's current thread count, at most this).
    """

    def __init__(self, cfg: ModelConfig, cos: np.ndarray, sin: np.ndarray, threads: int,
                 local: tuple[np.ndarray, np.ndarray] | None = None,
                 qk_norms: list[tuple[np.ndarray, np.ndarray]] | None = None, pool: str | None = None):
        if threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        if cfg.local_rope_theta and local is None:
            raise ConfigError("this model's windowed layers have their own RoPE base: pass their (cos, sin) as local")
        if cfg.qk_norm and (qk_norms is None or len(qk_norms) != cfg.n_layers):
            raise ConfigError("a QK-norm model's attention needs every layer's (q_norm, k_norm) weights")
        self.cfg, self.threads, self.pool = cfg, threads, pool  # pool: the runtime's ORT pool mode (`ExecutionPlan`)
        self.cos, self.sin = np.ascontiguousarray(cos), np.ascontiguousarray(sin)
        self.local = None if local is None else (np.ascontiguousarray(local[0]), np.ascontiguousarray(local[1]))
        self.qk_norms = qk_norms
        # every layer alike: one graph (built at a session's first use: a runtime whose layers are whole-layer graphs
        # never runs this one, and a warm start imports no onnx)
        self._uniform = len(set(cfg.windows)) == 1 and local is None and qk_norms is None
        self._sessions: dict[tuple[int, int], ort.InferenceSession] = {}
        # GroupQueryAttention rotates a multiple of 16 dims (its cos cache: columns a multiple of 8): other
        # heads (tiny test models, partial rotary) run `model.attention` on the rows, after the QK-norm here
        self._torch = None
        if (cfg.rotary_dim // 2) % 8:
            self._torch = (dataclasses.replace(cfg, qk_norm=False), RopeTable(cfg, self.cos.shape[0]))
        # a row's numbers do not depend on its chunk (`serve.store.cut_invariant`); torch's attention picks its blocks
        # by the chunk's and the cache's lengths (a tiny partial-rotary model: ~1e-6 between cuts)
        self.cut_invariant = self._torch is None

    def tables(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The (cos, sin) RoPE table of layer `layer`: the windowed layers' own base where the model has one."""
        return self.local if self.cfg.local_rope(layer) else (self.cos, self.sin)  # type: ignore[return-value]

    def qk_norm(self, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Layer `layer`'s (q_norm, k_norm) weights [D] of a QK-norm model, else None (for a kernel that norms the
        rows itself, `native.attention`)."""
        return None if self.qk_norms is None else self.qk_norms[layer]

    def session(self, threads: int, window: int = 0) -> ort.InferenceSession:
        """The session running on `threads` intra-op threads for layers of this window (made once; no weights)."""
        s = self._sessions.get((threads, window))
        if s is None:
            s = self._sessions[threads, window] = cpu_session(_graph(self.cfg, window), threads, self.pool)
        return s

    def __call__(self, qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int,
                 out: np.ndarray, layer: int | None = None, base: int = 0) -> np.ndarray:
        """qkv [n, q_dim + 2·kv_dim] (the chunk's real rows, un-roped, contiguous) at positions start..start+n-1;
        k_cache/v_cache [n_kv, capacity, D] (one layer, contiguous) whose row 0 holds position `base` (a windowed
        layer keeping its window, `KVCache.place`); out [n, q_dim]; layer: which layer (needed when layers differ).
        Returns out. A QK-norm model's q/k rows are normalized in place first."""
        cfg, n = self.cfg, qkv.shape[0]
        if layer is None:
            if not self._uniform:
                raise ConfigError("this model's layers attend differently: pass the layer")
            layer = 0
        cap = k_cache.shape[1]
        if not 0 <= base <= start or start - base + n > cap or start + n > self.cos.shape[0]:
            raise ConfigError(f"chunk rows {start}..{start + n} (row 0 at {base}) exceed the cache ({cap}) or RoPE "
                              f"table ({self.cos.shape[0]}) positions")
        if self.qk_norms is not None:
            qk_norm_(cfg, qkv, *self.qk_norms[layer])
        if n == 1 and start - base + 2 <= cap and start + 2 <= self.cos.shape[0]:
            return row_twice(qkv, k_cache, v_cache, start - base, out,
                             lambda x, y: self._rows(x, k_cache, v_cache, start, y, layer, base))
        return self._rows(qkv, k_cache, v_cache, start, out, layer, base)

    def _rows(self, qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int, out: np.ndarray, layer: int,
              base: int) -> np.ndarray:
        """The attention of the rows (QK-normed already): torch's for heads GroupQueryAttention cannot rotate, else
        the GroupQueryAttention node."""
        if self._torch is not None:
            self._torch_rows(qkv, k_cache, v_cache, start, out, layer, base)
            return out
        cos, sin = self.tables(layer)
        return self._gqa(qkv, k_cache, v_cache, start, out, layer, base, cos, sin)

    def _gqa(self, qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int, out: np.ndarray, layer: int,
             base: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """The GroupQueryAttention node on the rows (`__call__`'s arguments; cos/sin the layer's table)."""
        cfg, n = self.cfg, qkv.shape[0]
        # GroupQueryAttention ropes the new rows at positions past + i (past: the rows before them): from `base`
        # on, the rows hold positions - base and the table is read from its row `base`
        cos, sin, start = cos[base:], sin[base:], start - base
        f32 = np.float32
        # as many threads as the lane's torch share (`sched.executor.LaneWorkers`: one while another lane runs,
        # all while it runs alone): two lanes' pools on the same cores would wait on each other's threads
        session = self.session(max(1, min(lane_threads(), self.threads)), cfg.window(layer))
        b = session.io_binding()
        b.bind_input("qkv", "cpu", 0, f32, (1, n, qkv.shape[1]), f32_address(qkv, "attention: qkv"))
        for name, t in (("past_key", k_cache), ("past_value", v_cache)):
            b.bind_input(name, "cpu", 0, f32, (1, *t.shape), f32_address(t, f"attention: {name}"))
            b.bind_output(name.replace("past", "present"), "cpu", 0, f32, (1, *t.shape), t.ctypes.data)
        b.bind_cpu_input("seqlens_k", np.array([start + n - 1], dtype=np.int32))
        b.bind_cpu_input("total_len", np.array(start + n, dtype=np.int32))
        b.bind_input("cos", "cpu", 0, f32, tuple(cos.shape), cos.ctypes.data)
        b.bind_input("sin", "cpu", 0, f32, tuple(sin.shape), sin.ctypes.data)
        b.bind_output("out", "cpu", 0, f32, (1, n, cfg.q_dim), f32_address(out, "attention: out"))
        session.run_with_iobinding(b)
        return out


    def _torch_rows(self, qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int, out: np.ndarray,
                    layer: int, base: int) -> None:
        """`model.attention` on the rows (heads GroupQueryAttention cannot rotate), through torch views."""
        import torch

        from hetero.model import attention as model_attention

        plain, rope = self._torch
        cfg, n = self.cfg, qkv.shape[0]
        qd, kd = cfg.q_dim, cfg.kv_dim
        t = torch.from_numpy(qkv)
        with torch.inference_mode():
            torch.from_numpy(out).copy_(model_attention(
                plain, t[:, :qd], t[:, qd : qd + kd], t[:, qd + kd :], rope, torch.from_numpy(k_cache),
                torch.from_numpy(v_cache), start, n, layer=layer, base=base))


def qk_norm_(cfg: ModelConfig, qkv: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray) -> None:
    """RMSNorm of each q and k head of the packed rows, in place (`model.attention`'s QK-norm, same ops, through
    torch views)."""
    import torch

    from hetero.model import rms_norm

    n, qd, kd, d = qkv.shape[0], cfg.q_dim, cfg.kv_dim, cfg.head_dim
    t = torch.from_numpy(qkv)
    q, k = t[:, :qd].view(n, cfg.n_heads, d), t[:, qd : qd + kd].view(n, cfg.n_kv_heads, d)
    with torch.inference_mode():
        q.copy_(rms_norm(q, torch.from_numpy(q_norm), cfg.rms_eps))
        k.copy_(rms_norm(k, torch.from_numpy(k_norm), cfg.rms_eps))
