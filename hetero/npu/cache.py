"""The prebuilt-graph cache: compiled graphs on disk under a content hash (mllm-NPU §3.2, §2.3).

Building and optimizing an NPU graph takes hundreds of ms to seconds per graph (§2.3, Fig. 2); a
prepared graph is therefore a pure function of its inputs, stored once and loaded thereafter:

    cache_dir()/graphs/<backend>/<key>/
        model.onnx [+ model.data]   the exported QDQ/INT8 graph (external data when large)
        compiled.onnx               ORT CPU EP: the optimized model; QNN: the EP context model with
                                    the QNN context binary embedded (ep.context_embed_mode=1)
        meta.json                   written last: key, spec, size and sha256 of every file

`key` hashes the layer's parameters (`export.layer_digest`), the model fingerprint, the segment spec
(C, shape, flavour), the backend options and the library versions (onnx, onnxruntime,
onnxruntime-qnn, EXPORT_VERSION). An entry whose meta.json is missing, unreadable, of another key, or
whose files differ in size or (sampled, `_sha`) hash, or that fails to load, is *stale or corrupt*: it is deleted and rebuilt with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from hetero.errors import GraphCacheError
from hetero.paths import atomic_path, cache_dir

log = logging.getLogger(__name__)

META = "meta.json"
COMPILED = "compiled.onnx"


@functools.cache
def library_versions() -> dict[str, str]:
    import onnx
    import onnxruntime

    v = {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
    try:
        import importlib.metadata as md

        v["onnxruntime-qnn"] = md.version("onnxruntime-qnn")
    except Exception:  # not installed: part of the key as absent
        v["onnxruntime-qnn"] = "absent"
    return v


def entry_key(*parts: object) -> str:
    """sha256 over the JSON of `parts` (sorted keys), 32 hex digits."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def graphs_root() -> Path:
    return cache_dir() / "graphs"


_FULL_HASH_MAX = 4 << 20  # files up to 4 MiB are hashed whole
_SAMPLE = 256 << 10


def _sha(path: Path) -> str:
    """sha256 of a file; above 4 MiB of its size + 17 evenly spaced 256 KiB blocks (head, tail included).

    Loading must stay far cheaper than building (QNN context binaries are ~9 MB a graph); a damaged
    file the sample misses still fails to deserialize, which `prepare_graph` also treats as corrupt.
    """
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if size <= _FULL_HASH_MAX:
            h.update(f.read())
        else:
            for i in range(17):
                f.seek((size - _SAMPLE) * i // 16)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One cache directory; `valid()` checks it, `read_compiled()` returns the verified bytes."""

    root: Path  # cache_dir()/graphs/<backend>/<key>
    key: str

    @classmethod
    def of(cls, backend: str, key: str) -> "CacheEntry":
        return cls(graphs_root() / backend / key, key)

    @property
    def model_path(self) -> Path:
        return self.root / "model.onnx"

    @property
    def compiled_path(self) -> Path:
        return self.root / COMPILED

    def read_compiled(self) -> Path | None:
        """The compiled graph's path if the entry is complete and intact (all files verified); None if absent.

        Raises GraphCacheError (with the reason) for a stale or corrupt entry.
        """
        meta_path = self.root / META
        if not meta_path.exists():
            if self.root.exists():
                raise GraphCacheError(f"graph cache entry {self.root} has no {META} (interrupted build)")
            return None
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as e:
            raise GraphCacheError(f"graph cache entry {self.root}: unreadable {META}: {e}") from e
        if meta.get("key") != self.key:
            raise GraphCacheError(f"graph cache entry {self.root}: key {meta.get('key')!r} != {self.key!r} (stale)")
        files = meta.get("files", {})
        if COMPILED not in files:
            raise GraphCacheError(f"graph cache entry {self.root}: {META} lists no {COMPILED}")
        for name, info in files.items():
            p = self.root / name
            if not p.exists() or p.stat().st_size != info["size"]:
                raise GraphCacheError(f"graph cache entry {self.root}: {name} missing or truncated")
        for name, info in files.items():  # the compiled model may point at model.data: verify all
            if _sha(self.root / name) != info["sha256"]:
                raise GraphCacheError(f"graph cache entry {self.root}: {name} fails its sha256 (corrupt)")
        return self.compiled_path

    def discard(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def commit(self, spec: object, extra: dict | None = None) -> None:
        """Write meta.json last (atomically): from now on the entry counts as built."""
        files = {}
        for p in sorted(self.root.iterdir()):
            if p.is_file() and p.name != META and not p.name.startswith("."):
                files[p.name] = {"size": p.stat().st_size, "sha256": _sha(p)}
        if COMPILED not in files:
            raise GraphCacheError(f"graph cache entry {self.root}: nothing compiled to commit")
        meta = {"key": self.key, "spec": asdict(spec) if hasattr(spec, "__dataclass_fields__") else spec,
                "files": files, "versions": library_versions(), **(extra or {})}
        with atomic_path(self.root / META) as tmp:
            tmp.write_text(json.dumps(meta, indent=1, default=str))

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.iterdir() if p.is_file()) if self.root.exists() else 0
