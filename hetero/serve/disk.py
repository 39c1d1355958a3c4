"""The disk tier: one file per K/V block, written atomically (temp name, then `os.replace`).

LLMS §3.4 writes chunks ahead of time (at the end of every call) so that reclaiming memory later only
drops the RAM copy; a dedicated IO thread writes them and another reads them back during a restore
(LLMS §3.3, the swapping half of the swapping-recompute pipeline). A block file is a safetensors file of
numpy arrays: float `k`/`v`, or a compressed block's codes, minimums and scales with its level and shape in
the header (the files live in a private folder removed on close: no other process reads them).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from hetero.paths import atomic_path
from hetero.serve.quant import QTensor, dequantize


class DiskTier:
    """Block files under a private directory that is removed on `close()`."""

    def __init__(self, root: Path | None):
        base = Path(root) if root is not None else None
        if base is not None:
            base.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="kv-", dir=base))
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="kv-write")
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="kv-read")

    def path(self, uid: int) -> Path:
        return self.dir / f"{uid}.safetensors"

    def write(self, uid: int, payload: dict) -> tuple[Path, int, float]:
        """Write a block's payload (float `k`/`v`, or a compressed one); returns (path, bytes, ms)."""
        t0 = time.perf_counter()
        target = self.path(uid)
        tensors, meta = _encode(payload)
        with atomic_path(target) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
        return target, target.stat().st_size, (time.perf_counter() - t0) * 1e3

    def submit_write(self, uid: int, payload: dict) -> Future:
        return self.writer.submit(self.write, uid, payload)

    def submit_read(self, path: Path) -> Future:
        return self.reader.submit(read_block, path)

    def close(self) -> None:
        self.writer.shutdown(wait=True)
        self.reader.shutdown(wait=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def free_bytes(folder: Path | None) -> int:
    """Free bytes on the file system that holds `folder` (None: the system temp dir), or its nearest
    existing parent."""
    p = Path(folder if folder is not None else tempfile.gettempdir()).resolve()
    while not p.exists():
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def default_disk_budget(folder: Path | None, share: float = 0.25, cap: int = 16 << 30) -> int:
    """The swap folder's budget when none is given: a quarter of the free space there, at most 16 GiB, so a
    busy server never fills the disk (it wrote 793 MB in a minute under 16 clients)."""
    return int(min(cap, share * free_bytes(folder)))


def float_payload(k: np.ndarray, v: np.ndarray) -> dict:
    return {"k": k, "v": v}


def compressed_payload(qk: QTensor, qv: QTensor) -> dict:
    return {"q": [qk, qv]}


def _encode(payload: dict) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A payload as the arrays and the text header of its block file."""
    if "k" in payload:
        return ({"k": np.ascontiguousarray(payload["k"]), "v": np.ascontiguousarray(payload["v"])},
                {"kind": "float"})
    tensors, meta = {}, {"kind": "compressed"}
    for name, q in zip("kv", payload["q"]):
        tensors.update({f"{name}.codes": q.codes, f"{name}.lo": q.lo, f"{name}.scale": q.scale})
        meta[name] = json.dumps({"level": q.level, "shape": list(q.shape)})
    return tensors, meta


def _decode(tensors: dict[str, np.ndarray], meta: dict[str, str]) -> dict:
    if meta.get("kind") == "float":
        return float_payload(tensors["k"], tensors["v"])
    qs = []
    for name in "kv":
        head = json.loads(meta[name])
        qs.append(QTensor(head["level"], tensors[f"{name}.codes"], tensors[f"{name}.lo"], tensors[f"{name}.scale"],
                          tuple(head["shape"])))
    return compressed_payload(*qs)


def read_block(path: Path) -> tuple[dict, int, float]:
    """(payload, bytes read, ms)."""
    t0 = time.perf_counter()
    with safe_open(str(path), framework="numpy") as f:
        payload = _decode({name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {})
    return payload, path.stat().st_size, (time.perf_counter() - t0) * 1e3


def payload_kv(payload: dict) -> tuple[np.ndarray, np.ndarray]:
    """Float K/V of a payload (dequantised if it was stored compressed)."""
    if "k" in payload:
        return payload["k"], payload["v"]
    qk, qv = payload["q"]
    return dequantize(qk), dequantize(qv)
