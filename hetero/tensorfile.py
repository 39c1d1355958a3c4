"""A safetensors file's tensors as numpy arrays that map the file (copy on write): nothing is read until used.

safetensors' own numpy API copies every tensor out of its mapping (85 ms for the 135 MB of INT8 weights, and
651 MB for a rotated model's float weights); its torch API maps them, but importing torch is most of a warm
start's time. The format is an 8-byte header length, a JSON header naming each tensor's dtype,
shape and byte span, then the bytes (https://huggingface.co/docs/safetensors): this reads that header and
views the spans. Files are written with `safetensors.numpy.save_file` (or its torch twin); tests check this
reader against the library's.
"""

from __future__ import annotations

import json
import struct
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
