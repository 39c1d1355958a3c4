"""A safetensors file's tensors as numpy arrays that map the file (copy on write): nothing is read until used.

safetensors' own numpy API copies every tensor out of its mapping (85 ms for the 135 MB of INT8 weights, and
651 MB for a rotated model's float weights); its torch API maps them, but importing torch is most of a warm
start's time. The format is an 8-byte header length, a JSON header naming each tensor's dtype,
shape and byte span, then the bytes (https://huggingface.co/docs/safetensors): this reads that header and
views the spans. Files are written with `safetensors.numpy.save_file` (or its torch twin), or, where set-up
makes tensors one at a time or in pieces (float weights, packed GEMV weights), with `write_tensors` (the same
bytes); tests check both against the library.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hetero import progress
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
# the library's data order: by dtype, these first (a Rust enum's order, reversed), then by name (tested against it)
_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "F16", "U16", "I16", "I8", "U8", "BOOL")
_CODES = {np.dtype(v): k for k, v in _DTYPES.items()}

Put = Callable[[str, np.ndarray], None]  # hands over the next rows (along axis 0) of tensor `name`


@dataclass(frozen=True)
class LazyTensors:
    """Tensors handed over in pieces as they are made (`pieces(put)`: each tensor's rows in order, whole or in
    blocks, the tensors in any order, interleaved as they come out of one computation, such as a packed weight and
    its scales), by name with their shapes and dtypes (float32 unless `dtypes` names another): what set-up writes
    to a safetensors file (`write_tensors`) without holding them all in memory; at 1B width a model's float32
    weights are 4.7 GB, and a writer of a dict of them holds that twice (the library serializes to bytes).
    `what`: the set-up step that makes them, a progress bar's label (`progress.bar`, in bytes made)."""

    shapes: dict[str, tuple[int, ...]]
    pieces: Callable[[Put], None]
    dtypes: dict[str, np.dtype] = field(default_factory=dict)
    what: str = "write tensors"

    def __post_init__(self) -> None:
        bad = [n for n in self.shapes if self.dtype(n) not in _CODES]
        if bad:
            raise ValueError(f"{bad[0]}: safetensors has no dtype {self.dtype(bad[0])}")

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self.dtypes.get(name, np.float32))

    def nbytes(self, name: str) -> int:
        return self.dtype(name).itemsize * int(np.prod(self.shapes[name], dtype=np.int64))

    def arrays(self) -> dict[str, np.ndarray]:
        """Every tensor in memory (where there is no file to write them to: a read-only cache)."""
        out = {name: np.empty(self.shapes[name], self.dtype(name)) for name in self.shapes}

        def put(name: str, at: int, a: np.ndarray) -> None:
            _bytes(out[name])[at : at + a.nbytes] = _bytes(a)

        self.emit(put)
        return out

    def emit(self, put: Callable[[str, int, np.ndarray], None]) -> None:
        """Hand every tensor's bytes to put(name, byte offset in the tensor, contiguous piece) as `pieces` makes
        them; ModelFormatError for a piece unlike its tensor (the file would not read back), or a tensor left
        short."""
        done = dict.fromkeys(self.shapes, 0)
        bar = progress.bar(sum(self.nbytes(n) for n in self.shapes), self.what, "B")

        def piece(name: str, a: np.ndarray) -> None:
            if name not in self.shapes:
                raise ModelFormatError(f"{name} is not one of the file's tensors")
            a = np.asarray(a)
            a = a if a.flags.c_contiguous else a.copy(order="C")
            shape = tuple(self.shapes[name])
            fits = a.shape == shape if not shape else a.shape[1:] == shape[1:]
            if a.dtype != self.dtype(name) or not fits or done[name] + a.nbytes > self.nbytes(name):
                raise ModelFormatError(f"a piece of {name} has shape {a.shape} ({a.dtype}), past or unlike the "
                                       f"file's {shape} ({self.dtype(name)}) after {done[name]} bytes")
            put(name, done[name], a)
            done[name] += a.nbytes
            bar.update(a.nbytes)

        self.pieces(piece)
        bar.close()
        short = [n for n in self.shapes if done[n] != self.nbytes(n)]
        if short:
            raise ModelFormatError(f"{short[0]} was handed {done[short[0]]} of its {self.nbytes(short[0])} bytes")


def _bytes(a: np.ndarray) -> np.ndarray:
    """A contiguous array's bytes as a flat uint8 view."""
    return a.reshape(-1).view(np.uint8)


def write_tensors(tensors: LazyTensors, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (and `metadata`) as safetensors file `path`, a piece at a time in the order they are made:
    the bytes `safetensors.numpy.save_file` writes for the same tensors (its header: compact JSON, the metadata
    first, then the tensors in its data order, spaces to a multiple of 8), so a cache entry's content does not
    depend on which wrote it."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offsets, offset = {}, 0
    for name in sorted(tensors.shapes, key=lambda n: (_ORDER.index(_CODES[tensors.dtype(n)]), n)):
        shape = [int(d) for d in tensors.shapes[name]]
        offsets[name] = offset
        header[name] = {"dtype": _CODES[tensors.dtype(name)], "shape": shape,
                        "data_offsets": [offset, offset + tensors.nbytes(name)]}
        offset += tensors.nbytes(name)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        start = f.tell()

        def put(name: str, at: int, a: np.ndarray) -> None:
            if f.tell() != start + offsets[name] + at:  # pieces of several tensors interleaved
                f.seek(start + offsets[name] + at)
            f.write(_bytes(a))  # no bytes copy of the piece

        tensors.emit(put)
