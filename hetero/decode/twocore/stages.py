"""The split forms of a one-row step's graphs (`halves`) as C API sessions (`ortc`) bound to the step's buffers:
the helper thread and the main thread each run one column half of every stage (`attnpool.AttentionPool.run_stages`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hetero import buffers
from hetero.decode.twocore import ortc
from hetero.decode.twocore.attnpool import StageTable

if TYPE_CHECKING:
    import onnx


class Stages:
    """The split forms (`halves`) of a one-row step's graphs as C API sessions bound to the step's buffers: stage i
    is session ms[i] / binding mb[i] (its first column half, or a tail) and hs[i] / hb[i] (its second half)."""

    def __init__(self) -> None:
        self.ortc = ortc.OrtC.get()
        self.ms: list[int] = []
        self.mb: list[int] = []
        self.hs: list[int] = []
        self.hb: list[int] = []
        self._keep: list[object] = []  # sessions, bindings and intermediate buffers

    def add(self, model: "onnx.ModelProto", ins: dict[str, np.ndarray], outs: dict[str, np.ndarray]
            ) -> tuple[int, int] | None:
        """The stages of one graph reading `ins` and writing `outs` ([1, width] C-contiguous float32 buffers); None if
        it has no splittable matmul."""
        from hetero.decode.twocore import halves  # onnx: only when a step splits (`BoundStep.split`)

        split = halves.split_graph(model)
        if split is None:
            return None
        env = dict(ins) | dict(outs)
        for name, width in split.widths.items():
            if name not in env:
                env[name] = buffers.zeros((1, width))
        self._keep.append(env)
        first = len(self.ms)
        for stage in split.stages:
            bound = []
            for h, half in enumerate(stage.halves):
                sess = self.ortc.session(half)
                names_in = [i.name for i in half.graph.input]
                names_out = [o.name for o in half.graph.output]
                b = sess.bind({n: (_address(env[n]), env[n].shape) for n in names_in},
                              {n: self._column_half(env[n], stage.split, n, h) for n in names_out})
                self._keep += [sess, b]
                bound.append((sess.ptr, b.ptr))
            (ms, mb), (hs, hb) = bound[0], bound[1] if len(bound) == 2 else (0, 0)
            self.ms.append(ms), self.mb.append(mb), self.hs.append(hs), self.hb.append(hb)
        return first, len(self.ms)

    @staticmethod
    def _column_half(t: np.ndarray, split: dict[str, int], name: str, half: int) -> tuple[int, tuple[int, ...]]:
        """(address, shape) of what a half writes of buffer t: its columns of a split matmul's output, else all."""
        if name not in split:
            return _address(t), t.shape
        from hetero.decode.twocore import halves

        lo, hi = halves.columns(split[name], half)
        return _address(t) + 4 * lo, (1, hi - lo)

    def table(self) -> StageTable:
        as_array = lambda xs: np.asarray(xs, np.int64)  # noqa: E731
        return StageTable(self.ortc.run_fn, as_array(self.ms), as_array(self.mb), as_array(self.hs),
                          as_array(self.hb), self.ortc.check)


def _address(a: np.ndarray) -> int:
    """The address of a buffer a C API session reads or writes in place (C-contiguous float32, kept alive by the
    caller)."""
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise ValueError(f"split graph buffers must be C-contiguous float32, got {a.dtype} with strides {a.strides}")
    return a.ctypes.data


def split_available(backend) -> bool:
    """Whether a backend's one-row graphs can run split (`halves`): ONNX Runtime CPU graphs from the graph cache,
    and the wheel's C library loads."""
    return backend.splittable and ortc.run_fn() != 0
