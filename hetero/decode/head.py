"""The LM head of a decode step: float (exact, for the float reference), INT8, or MatMulNBits (`NbitsHead`) on the
INT8 lane.

A decode step reads every weight once per token, so the head's 49k×576 float matrix alone would cost
as much memory traffic as a third of the layers; on an INT8 runtime it runs as one ONNX Runtime
`MatMulInteger` graph: weights symmetric per output channel, activations symmetric per ROW (so a row's
logits do not depend on the other rows of a token tree: speculation stays exact), rescaled in one compiled pass.

Heads take numpy hidden rows and return numpy logits; the INT8 heads read the weights at rest (`Model.arrays`) and
import no torch, the float reference's (`FloatHead`) runs torch's ops, imported when it runs.
"""

from __future__ import annotations

from collections.abc import Callable

from typing import TYPE_CHECKING

import numpy as np

from hetero import buffers
from hetero import jitcache
from hetero.config import ModelConfig
from hetero.decode.twocore import ortc
from hetero.decode.twocore.attnpool import AttentionPool, StageTable
from hetero.loader import Model, row_blocks
from hetero.weights import Weights
from hetero.outliers.weightcache import cached_arrays
from hetero.outliers.quantize import W_QMAX_U8S8
from hetero.sessions import cpu_session

if TYPE_CHECKING:
    import onnx
    import torch


def _rows(h: np.ndarray, hidden: int) -> np.ndarray:
    """Hidden rows [..., hidden] as C-contiguous float32 [n, hidden] (a view when they already are)."""
    return np.ascontiguousarray(np.asarray(h, np.float32).reshape(-1, hidden))


class FloatHead:
    """final RMSNorm + the float LM head (the reference), a row at a time: torch's GEMM over a tree's rows sums in
    another order than its GEMV over one row, so a tree row's logits were not the one-row step's."""

    name = "float"

    def __init__(self, cfg: ModelConfig, weights: Weights):
        self.cfg, self.weights = cfg, weights

    def __call__(self, h: np.ndarray) -> np.ndarray:
        import torch

        from hetero import model as ref

        x = torch.from_numpy(_rows(h, self.cfg.hidden))
        with torch.inference_mode():
            out = torch.cat([ref.logits(self.cfg, self.weights, x[i : i + 1]) for i in range(x.shape[0])]).numpy()
        return out.reshape(*np.shape(h)[:-1], -1)


def quantize_head(w: "np.ndarray | torch.Tensor") -> tuple[np.ndarray, np.ndarray]:
    """W^T [hidden, vocab] quantized per output channel to 7 bits (u8·s8 pairs cannot saturate AVX2's 16-bit
    intermediate, as the layer graphs' plan), and the scales [vocab] float32. w: [vocab, hidden] (numpy, or a
    CPU torch tensor), read a block of rows at a time (`loader.row_blocks`: a row's scale is its own)."""
    vocab, hidden = w.shape
    wq, scale = np.empty((vocab, hidden), np.int8), np.empty(vocab, np.float32)
    for rows, block in row_blocks(w):
        scale[rows] = np.maximum(np.abs(block).max(axis=1), 1e-12) / W_QMAX_U8S8
        wq[rows] = np.clip(np.round(block / scale[rows, None]), -W_QMAX_U8S8, W_QMAX_U8S8)
    return wq.T, scale


def head_graph(wq: np.ndarray) -> "onnx.ModelProto":
    """[T, hidden] uint8 (zero point 128) → [T, vocab] int32: MatMulInteger over the quantized W^T (`quantize_head`);
    u8·s8 (activations shifted by 128, a zero point) is ONNX Runtime's fast integer kernel."""
    from onnx import TensorProto, helper, numpy_helper  # only when built: a warm start loads the serialized graphs

    node = helper.make_node("MatMulInteger", ["x_q", "w_q", "x_z"], ["acc"])
    graph = helper.make_graph([node], "lm_head_int8",
                              [helper.make_tensor_value_info("x_q", TensorProto.UINT8, ["T", wq.shape[0]])],
                              [helper.make_tensor_value_info("acc", TensorProto.INT32, ["T", wq.shape[1]])],
                              [numpy_helper.from_array(wq, "w_q"), numpy_helper.from_array(np.uint8(128), "x_z")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def int8_head_graph(w: "np.ndarray | torch.Tensor") -> tuple["onnx.ModelProto", np.ndarray]:
    """The head graph of `w` (`head_graph`) and its weight scales [vocab] float32."""
    wq, scale = quantize_head(w)
    return head_graph(wq), scale


class Int8Head:
    """final RMSNorm (float, CPU lane) + the INT8 LM head graph (ONNX Runtime), in two halves of the vocabulary.

    Each half is its own `MatMulInteger` graph over half of W's output channels: a logit is the same integer sum
    in either, so the logits equal one whole-vocabulary graph's. Beside a helper thread (`attnpool`) the halves
    are C API sessions (`ortc`) and run on two cores as one stage (`AttentionPool.run_stages`), each streaming half
    of the 28 MB of weights; without one they are Python API sessions (on the process's pool in its shared mode)."""

    name = "int8"

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], threads: int = 2,
                 pool: AttentionPool | None = None, model: Model | None = None, ort_pool: str | None = None):
        """weights: the model's arrays by cache name (`Model.arrays`: "norm" and "lm_head" are read). model: the model
        of `weights` when it has a cache entry, which then keeps the quantized head (`outliers.weightcache`:
        quantizing 49k×576 weights took ~0.3-1 s a start)."""
        self.cfg, self.pool = cfg, pool
        self.norm = weights["norm"]
        half = (cfg.vocab // 2 + 63) // 64 * 64
        self.parts = [(0, half), (half, cfg.vocab)]

        def quantize() -> dict[str, np.ndarray]:
            """The scales and the two halves' graphs, serialized: what a warm start loads (building the graphs
            from the weights took ~90 ms of every start)."""
            wq, scale = quantize_head(weights["lm_head"])
            graphs = [head_graph(np.ascontiguousarray(wq[:, lo:hi])).SerializeToString() for lo, hi in self.parts]
            return {"scale": scale, **{f"graph{i}": np.frombuffer(g, np.uint8) for i, g in enumerate(graphs)}}

        form = {"qmax": W_QMAX_U8S8, "parts": self.parts, "graphs": "serialized"}
        q = quantize() if model is None else cached_arrays(model, "head-int8", form, quantize)
        graphs = [q[f"graph{i}"].tobytes() for i in range(len(self.parts))]
        self.w_scale = q["scale"]
        self._ortc = ortc.OrtC.get() if pool is not None and ortc.run_fn() else None
        if self._ortc is not None:
            self.sessions = [self._ortc.session(g) for g in graphs]
        else:
            self.sessions = [cpu_session(g, threads, ort_pool) for g in graphs]
        self._bindings: dict[int, tuple[np.ndarray, list[np.ndarray], Callable[[], None]]] = {}

    def _bound(self, rows: int) -> tuple[np.ndarray, list[np.ndarray], Callable[[], None]]:
        """The input and output buffers of `rows` rows and a run of both halves bound to them, made once per row
        count (a decode step asks for 1, 2, 4 or 8 rows)."""
        b = self._bindings.get(rows)
        if b is None:
            xq = np.empty((rows, self.cfg.hidden), np.uint8)
            accs = [np.empty((rows, hi - lo), np.int32) for lo, hi in self.parts]
            if self._ortc is not None:
                bound = [sess.bind({"x_q": (xq.ctypes.data, xq.shape, np.uint8)},
                                   {"acc": (acc.ctypes.data, acc.shape, np.int32)})
                         for sess, acc in zip(self.sessions, accs)]
                table = StageTable(self._ortc.run_fn, *(np.array([x.ptr], np.int64) for x in (
                    bound[0].session, bound[0], bound[1].session, bound[1])), self._ortc.check)

                def run(table=table, keep=bound) -> None:  # both halves at once beside the helper
                    self.pool.run_stages(table, 0, 1)
            else:
                bindings = []
                for sess, acc in zip(self.sessions, accs):
                    binding = sess.io_binding()
                    binding.bind_input("x_q", "cpu", 0, np.uint8, xq.shape, xq.ctypes.data)
                    binding.bind_output("acc", "cpu", 0, np.int32, acc.shape, acc.ctypes.data)
                    bindings.append((sess, binding))

                def run(bindings=bindings) -> None:
                    for sess, binding in bindings:
                        sess.run_with_iobinding(binding)
            b = self._bindings[rows] = (xq, accs, run)
        return b

    def __call__(self, h: np.ndarray) -> np.ndarray:
        if np.size(h) == 0:  # a step that only writes K/V (a drafter catching up) asks for no logits
            return buffers.empty((*np.shape(h)[:-1], self.cfg.vocab))
        x = self._norm(_rows(h, self.cfg.hidden))
        xq, accs, run = self._bound(x.shape[0])
        s = np.empty(x.shape[0], np.float32)
        _quantize_rows(x, xq, s)
        run()
        out = buffers.empty((x.shape[0], self.cfg.vocab))
        _scale_logits(accs[0], accs[1], s, self.w_scale, out)
        return out.reshape(*np.shape(h)[:-1], -1)

    def _norm(self, x: np.ndarray) -> np.ndarray:
        """The final RMSNorm (`model.rms_norm`'s formula in float32: x · rsqrt(mean(x²) + eps) · w; its sums rounded
        as numpy adds, not as torch)."""
        ms = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
        return x * (np.float32(1.0) / np.sqrt(ms + np.float32(self.cfg.rms_eps))) * self.norm


class NbitsHead:
    """final RMSNorm + the LM head as one MatMulNBits graph (`npu.nbits.head_graph`: 8-bit weights in blocks of 128,
    int8 activations per block at run time), cached and verified like the layers' graphs; on the default model
    ~0.6× the INT8 head's time on one thread and a third of its largest error vs float (docs/journal.md,
    "Issue 24 item 3: decode on ONNX Runtime's MatMulNBits").
    Once its step splits (`split`, with the layers' graphs: `DecodeStep`), a one-row head beside the helper thread
    runs as two vocabulary halves on two cores (`twocore.halves`: bit for bit the whole graph)."""

    name = "nbits"

    def __init__(self, cfg: ModelConfig, model: Model, threads: int = 1, pool: AttentionPool | None = None,
                 ort_pool: str | None = None):
        from hetero.npu.nbits import head_session
        from hetero.npu.providers import OrtCpuProvider

        self.cfg, self.pool = cfg, pool
        self.session, self.path = head_session(model, OrtCpuProvider(threads, pool=ort_pool))
        self._bound: dict[int, tuple[np.ndarray, np.ndarray, Callable[[], None], bool]] = {}
        self._keep: list[object] = []

    def split(self) -> bool:
        """Run a one-row head as two vocabulary halves beside the helper from now on; whether it does."""
        from hetero.decode.twocore.stages import Stages

        if self.pool is None or self.path is None or not ortc.run_fn():
            return False
        bound = self._bound.get(1)
        if bound is not None and bound[3]:
            return True
        import onnx  # only when a long decode splits (`hetero run` imports no onnx)

        h, out, whole, _ = self._bind(1)
        stages = Stages()
        span = stages.add(onnx.load(str(self.path)), {"h": h}, {"logits": out})
        if span is None:
            return False
        table = stages.table()
        self._keep.append(stages)
        self._bound[1] = (h, out, lambda: self.pool.run_stages(table, *span), True)
        return True

    def _bind(self, rows: int) -> tuple[np.ndarray, np.ndarray, Callable[[], None], bool]:
        """The input and output buffers of `rows` rows and a run bound to them (made once per row count), and
        whether it runs split."""
        b = self._bound.get(rows)
        if b is None:
            h, out = buffers.zeros((rows, self.cfg.hidden)), buffers.zeros((rows, self.cfg.vocab))
            binding = self.session.io_binding()
            binding.bind_input("h", "cpu", 0, np.float32, h.shape, h.ctypes.data)
            binding.bind_output("logits", "cpu", 0, np.float32, out.shape, out.ctypes.data)
            b = self._bound[rows] = (h, out, lambda: self.session.run_with_iobinding(binding), False)
        return b

    def __call__(self, h: np.ndarray) -> np.ndarray:
        if np.size(h) == 0:  # a step that only writes K/V (a drafter catching up) asks for no logits
            return buffers.empty((*np.shape(h)[:-1], self.cfg.vocab))
        x = np.asarray(h, np.float32).reshape(-1, self.cfg.hidden)
        buf, out, run, _ = self._bind(x.shape[0])
        buf[...] = x
        run()
        return out.copy().reshape(*np.shape(h)[:-1], -1)


@jitcache.njit(nogil=True)
def _quantize_rows(x: np.ndarray, xq: np.ndarray, s: np.ndarray) -> None:  # pragma: no cover - compiled
    """Per-row symmetric INT8 with zero point 128: s[r] = max(amax|x_r|, 1e-12) / 127, xq = clip(rint(x/s), ±127)
    + 128 (float32 throughout, each value rounded as torch's elementwise ops would)."""
    for r in range(x.shape[0]):
        m = np.float32(0.0)
        for i in range(x.shape[1]):
            m = max(m, abs(x[r, i]))
        sr = max(m, np.float32(1e-12)) / np.float32(127.0)
        s[r] = sr
        for i in range(x.shape[1]):
            xq[r, i] = np.uint8(min(max(np.rint(x[r, i] / sr), np.float32(-127.0)), np.float32(127.0)) + np.float32(128.0))


@jitcache.njit(nogil=True)
def _scale_logits(acc0: np.ndarray, acc1: np.ndarray, s: np.ndarray, w_scale: np.ndarray,
                  out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[r, n] = float(acc[r, n])·s[r]·w_scale[n], acc the two vocabulary halves side by side."""
    half = acc0.shape[1]
    for r in range(out.shape[0]):
        for n in range(half):
            out[r, n] = np.float32(acc0[r, n]) * s[r] * w_scale[n]
        for n in range(acc1.shape[1]):
            out[r, half + n] = np.float32(acc1[r, n]) * s[r] * w_scale[half + n]
