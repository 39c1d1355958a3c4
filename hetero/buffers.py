"""Host buffers that ONNX Runtime's kernels read and write in place: aligned to 64 bytes, and large ones on small
pages.

numpy aligns an allocation to 16 bytes only (torch: 64), and advises the kernel to back one of 4 MB or more with
transparent huge pages (`MADV_HUGEPAGE`). A KV cache is sized for the whole context and written a few rows per
layer and head: on huge pages each first write zeroes 2 MB, 180 of them a prefill of SmolLM2-135M, and a 42-token
prefill took 85-95 ms instead of 55 (this machine's THP mode "madvise"). So a large buffer is an
anonymous mapping of its own (page-aligned, pages committed at their first write, 4 KB each), a small one an
aligned slice of a numpy allocation.

Each first write of a 4 KB page costs a fault (~6 µs in this project's VM): a fresh cache's 722 of them were 7% of a
64-token prefill and 9% of a 256-token one. So a KV cache's arrays are `recycled`: a mapping whose arrays are all
gone goes back to a small pool, and the next cache of that size takes it with its pages still committed.
"""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict

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


POOLED = 2  # mappings kept for `recycled` (one cache's K and V), the least recently returned dropped first
_pool: "OrderedDict[int, list[mmap.mmap]]" = OrderedDict()  # bytes → returned mappings of that size
_pool_lock = threading.RLock()  # re-entrant: a collection inside the lock may return another lease


class _Lease:
    """A pooled mapping lent to one array as its base (numpy keeps the object that gives an `__array_interface__`):
    when the array and every view of it are gone, the mapping goes back to the pool."""

    __slots__ = ("mm", "__array_interface__")

    def __init__(self, mm: mmap.mmap, shape: tuple[int, ...], dtype: np.dtype):
        self.mm = mm
        address = np.frombuffer(mm, np.uint8, count=1).ctypes.data
        self.__array_interface__ = {"data": (address, False), "shape": shape, "typestr": dtype.str, "version": 3}

    def __del__(self) -> None:
        if _pool_lock is None:  # interpreter shutdown
            return
        with _pool_lock:
            _pool.setdefault(len(self.mm), []).append(self.mm)
            _pool.move_to_end(len(self.mm))
            while sum(map(len, _pool.values())) > POOLED:
                oldest = next(iter(_pool))
                _pool[oldest].pop(0)
                if not _pool[oldest]:
                    del _pool[oldest]


def recycled(shape: tuple[int, ...], dtype: np.dtype | type = np.float32) -> np.ndarray:
    """`empty` for a large buffer made and dropped again and again (a KV cache per prompt): a pooled mapping of the
    same size when one is free, its pages already committed (its contents: whatever its last array held)."""
    dt = np.dtype(dtype)
    shape = tuple(shape)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if n < MAPPED:
        return empty(shape, dt)
    with _pool_lock:
        free = _pool.get(n)
        mm = free.pop() if free else None
        if free is not None and not free:
            del _pool[n]
    return np.asarray(_Lease(mm if mm is not None else mmap.mmap(-1, n), shape, dt))


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
