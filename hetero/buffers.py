"""Host buffers that ONNX Runtime's kernels read and write in place: aligned to 64 bytes, and large ones on small
pages.

numpy aligns an allocation to 16 bytes only (torch: 64), and advises the kernel to back one of 4 MB or more with
transparent huge pages (`MADV_HUGEPAGE`). A KV cache is sized for the whole context and written a few rows per
layer and head: on huge pages each first write zeroes 2 MB, 180 of them a prefill of SmolLM2-135M, and a 42-token
prefill took 85-95 ms instead of 55 (issue 28, this machine's THP mode "madvise"). So a large buffer is an
anonymous mapping of its own (page-aligned, pages committed at their first write, 4 KB each), a small one an
aligned slice of a numpy allocation.
"""

from __future__ import annotations

import mmap

import numpy as np

from hetero.errors import ConfigError

ALIGN = 64  # bytes: a cache line, one AVX-512 register
MAPPED = 1 << 20  # bytes from which a buffer is a mapping of its own


def empty(shape: int | tuple[int, ...], dtype: np.dtype | type = np.float32) -> np.ndarray:
    """An uninitialized array whose data starts on an ALIGN-byte boundary (pages committed when first written)."""
    dt = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if n >= MAPPED:  # freed with the array (its base holds the mapping)
        return np.frombuffer(mmap.mmap(-1, n), dtype=dt, count=n // dt.itemsize).reshape(shape)
    raw = np.empty(n + ALIGN, np.uint8)
    off = -raw.ctypes.data % ALIGN
    return raw[off : off + n].view(dt).reshape(shape)


def zeros(shape: int | tuple[int, ...], dtype: np.dtype | type = np.float32) -> np.ndarray:
    """`empty`, filled with zeros."""
    a = empty(shape, dtype)
    a.fill(0)
    return a


def aligned(a: np.ndarray) -> np.ndarray:
    """`a` itself when it is C-contiguous and aligned, else an aligned copy."""
    if a.flags.c_contiguous and a.ctypes.data % ALIGN == 0:
        return a
    out = empty(a.shape, a.dtype)
    out[...] = a
    return out


def f32_address(a: np.ndarray, what: str) -> int:
    """The address of a C-contiguous float32 numpy buffer that an ONNX Runtime binding reads or writes in place;
    ConfigError naming `what` for anything else (a strided view would be read as if it were contiguous)."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or not a.flags.c_contiguous:
        kind = f"{a.dtype} with strides {a.strides}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ConfigError(f"{what} must be a C-contiguous float32 numpy array, got {kind}")
    return a.ctypes.data
