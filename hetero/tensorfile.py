"""A safetensors file's tensors as numpy arrays that map the file (copy on write): nothing is read until used.

safetensors' own numpy API copies every tensor out of its mapping (85 ms for the 135 MB of INT8 weights, and
651 MB for a rotated model's float weights); its torch API maps them, but importing torch is most of a warm
start's time. The format is an 8-byte header length, a JSON header naming each tensor's dtype,
shape and byte span, then the bytes (https://huggingface.co/docs/safetensors): this reads that header and
views the spans. Files are written with `safetensors.numpy.save_file` (or its torch twin), or, where set-up
makes float weights one at a time, with `write_tensors` (the same bytes); tests check both against the library.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetero.errors import ModelFormatError

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64,
           "BOOL": np.bool_}


def map_tensors(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of safetensors file `path`; each tensor a writable copy-on-write view of the file's
    mapping (a write changes this process's pages only). ModelFormatError when the file is not safetensors."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with p.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        data = np.memmap(p, dtype=np.uint8, mode="c", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
        meta = header.pop("__metadata__", None) or {}
        out: dict[str, np.ndarray] = {}
        for name, info in header.items():
            a, b = info["data_offsets"]
            if not 0 <= a <= b <= data.size:
                raise ValueError(f"{name} lies past the end of the file")
            dtype = np.dtype(_DTYPES[info["dtype"]])
            out[name] = data[a:b].view(dtype).reshape(info["shape"])
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise ModelFormatError(f"{p} is not a readable safetensors file ({type(e).__name__}: {e})") from e
    return out, meta


class _ReadOnlyMap(mmap.mmap):
    """A mapping `read_only` made (ACCESS_READ): the only kind whose pages `drop_pages` hands back (dropping a
    written page of a copy-on-write mapping would lose the write)."""


def read_only(a: np.ndarray) -> np.ndarray:
    """`a`'s bytes through a read-only mapping of its own, where `a` views a file that `map_tensors` mapped; else `a`
    itself. Nothing can write such pages, so `drop_pages` may hand them back at any time: a later read faults them in
    from the file again (the page cache keeps them)."""
    base = a
    while isinstance(base.base, np.ndarray):
        base = base.base
    if not (isinstance(base, np.memmap) and base.filename and a.flags.c_contiguous and a.nbytes):
        return a
    start = base.offset + (a.ctypes.data - base.ctypes.data)  # the file's byte where `a` starts
    lead = start % mmap.ALLOCATIONGRANULARITY
    with open(base.filename, "rb") as f:
        m = _ReadOnlyMap(f.fileno(), lead + a.nbytes, access=mmap.ACCESS_READ, offset=start - lead)
    return np.frombuffer(m, dtype=a.dtype, count=a.size, offset=lead).reshape(a.shape)


def drop_pages(a: np.ndarray) -> None:
    """Unmap the resident pages of a `read_only` array (they stay in the page cache, out of this process's RSS);
    nothing for any other array, a read-only view of a writable mapping among them."""
    m = a.base
    while isinstance(m, np.ndarray):
        m = m.base
    if isinstance(m, memoryview):  # (`np.frombuffer`'s base)
        m = m.obj
    if isinstance(m, _ReadOnlyMap) and hasattr(mmap, "MADV_DONTNEED"):  # (not on Windows)
        m.madvise(mmap.MADV_DONTNEED)


_ALIGN = 8  # safetensors pads its header with spaces to a multiple of 8 bytes


@dataclass(frozen=True)
class LazyTensors:
    """Float32 tensors made one at a time (`make(name)`), by name with their shapes: what set-up writes to a
    safetensors file (`write_tensors`) without holding them all in memory; at 1B width a model's float32
    weights are 4.7 GB, and a writer of a dict of them holds that twice (the library serializes to bytes)."""

    shapes: dict[str, tuple[int, ...]]
    make: Callable[[str], np.ndarray]

    def arrays(self) -> dict[str, np.ndarray]:
        """Every tensor in memory (where there is no file to write them to: a read-only cache)."""
        return {name: self.made(name) for name in self.shapes}

    def made(self, name: str) -> np.ndarray:
        """Tensor `name` as a contiguous float32 array; ModelFormatError when `make` gives another shape or dtype
        than its header entry says (the file would not read back)."""
        a = np.asarray(self.make(name))
        a = a if a.flags.c_contiguous else a.copy(order="C")
        if a.dtype != np.float32 or a.shape != tuple(self.shapes[name]):
            raise ModelFormatError(f"{name} has shape {a.shape} ({a.dtype}), the file's header says "
                                   f"{tuple(self.shapes[name])} (float32)")
        return a


def write_tensors(tensors: LazyTensors, path: str | Path) -> None:
    """Write `tensors` as safetensors file `path`, one tensor in memory at a time: the bytes
    `safetensors.numpy.save_file` writes for the same tensors (its header: compact JSON in name order for one
    dtype, spaces to a multiple of 8; the data in that order), so a cache entry's content does not depend on
    which wrote it."""
    names = sorted(tensors.shapes)
    header, offset = {}, 0
    for name in names:
        shape = [int(d) for d in tensors.shapes[name]]
        size = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in names:
            f.write(tensors.made(name).reshape(-1).view(np.uint8))  # no bytes copy of the tensor
