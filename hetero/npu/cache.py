"""The prebuilt-graph cache: compiled graphs on disk under a content hash (mllm-NPU §3.2, §2.3).

`cache_dir()/graphs/<provider>/<key>/`: the exported model, the compiled one (ORT-optimized model or QNN
context model + binary) and meta.json, written last. The key hashes the layer's parameters, the model
fingerprint, the segment spec, provider options, library versions and the graph builders' source. Every file has a content record
(`paths.verify_files`: size + xxh3, checked in full at first use in a process, never trusting stat stamps);
a stale or corrupt entry is rebuilt with a warning. Layout: docs/design.md.
Processes sharing the cache build an entry once, under its lock (`graphs/.locks/`), in a private staging
folder renamed into place whole; an unwritable cache costs a warning and an uncached build.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock

from hetero.errors import GraphCacheError
from hetero.paths import atomic_path, cache_dir, file_record, verify_files

log = logging.getLogger(__name__)

META = "meta.json"
# 2: whole-file sha256 + stat stamps (1: sampled sha256). 3: the CPU EP's 8-bit linears are one
# com.microsoft.MatMulIntegerToFloat (was MatMulInteger → Cast → Mul). 4: xxh3 content records, no stamps.
# Part of every key: entries of an older format are never read (`hetero npu cache --clear` removes them).
FORMAT = 4
COMPILED = "compiled.onnx"


@functools.cache
def library_versions() -> dict[str, str]:
    """The versions of the libraries that build and run a graph, part of its key. onnx's from its installed
    metadata (the same string as `onnx.__version__`): a warm start keys its graphs without importing onnx."""
    import importlib.metadata as md

    import onnxruntime

    v = {"onnx": md.version("onnx"), "onnxruntime": onnxruntime.__version__}
    try:
        v["onnxruntime-qnn"] = md.version("onnxruntime-qnn")
    except Exception:  # not installed: part of the key as absent
        v["onnxruntime-qnn"] = "absent"
    return v


# The modules whose source decides what a cached graph holds: its export, compilation and session options. Their
# source is in every key (`builders_digest`), as numba's kernels (`hetero.jitcache`) and the plans
# (`outliers.plancache`) are keyed: an edit to one of them (an experiment, an upgrade that forgot a version bump)
# gets new keys, never another build's graph under the old one.
GRAPH_BUILDERS = ("npu/export.py", "npu/segments.py", "npu/site_ops.py", "npu/nbits.py", "npu/providers.py",
                  "attention.py", "outliers/quantize.py")


@functools.cache
def builders_digest() -> str:
    """sha256 of the source of `GRAPH_BUILDERS` (16 hex digits), read once per process."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in GRAPH_BUILDERS:
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes())
    return h.hexdigest()[:16]


def entry_key(*parts: object) -> str:
    """sha256 over the JSON of `parts` (sorted keys) and the graph builders' source (`builders_digest`), 32 hex
    digits."""
    blob = json.dumps([builders_digest(), *parts], sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def graphs_root(cache: Path | None = None) -> Path:
    """Where compiled graphs live: `<cache>/graphs`, `cache` defaulting to the user cache (`paths.cache_dir`)."""
    return (cache or cache_dir()) / "graphs"


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One cache directory; `read_compiled()` verifies it and says where the compiled graph is."""

    root: Path  # cache_dir()/graphs/<backend>/<key>
    key: str

    @classmethod
    def of(cls, backend: str, key: str, root: Path | None = None) -> "CacheEntry":
        """The entry of `key` under `root` (default `graphs_root()`)."""
        return cls((root or graphs_root()) / backend / key, key)

    @property
    def model_path(self) -> Path:
        return self.root / "model.onnx"

    @property
    def compiled_path(self) -> Path:
        return self.root / COMPILED

    def read_compiled(self) -> tuple[Path, int] | None:
        """(compiled graph's path, entry bytes) if the entry is complete and intact (all files verified);
        None if absent.

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
        bad = verify_files(self.root, files)
        if bad:
            raise GraphCacheError(f"graph cache entry {self.root}: {'; '.join(map(str, bad))}")
        return self.compiled_path, sum(info["size"] for info in files.values())

    def discard(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def lock(self, timeout_s: float = 600.0) -> FileLock:
        """The entry's inter-process lock (a file under graphs/.locks); hold it to build, repair or replace the entry."""
        locks = self.root.parent.parent / ".locks"  # apart from the entries, so listings see none
        locks.mkdir(parents=True, exist_ok=True)
        return FileLock(str(locks / f"{self.root.parent.name}-{self.key}.lock"), timeout=timeout_s)

    @contextlib.contextmanager
    def staging(self) -> Iterator["CacheEntry"]:
        """A private folder to build this entry in (call under `lock()`); on success it replaces the entry
        whole (`os.rename`), on failure it is deleted. Folders of killed builds of this key are removed."""
        self.root.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.root.parent.glob(f".build-{self.key}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{self.key}-", dir=self.root.parent))
        try:
            yield CacheEntry(tmp, self.key)
            self.discard()
            os.rename(tmp, self.root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def commit(self, spec: object, extra: dict | None = None) -> None:
        """Write meta.json last (atomically): from now on the entry counts as built."""
        files = {}
        for p in sorted(self.root.iterdir()):
            if p.is_file() and p.name != META and not p.name.startswith("."):
                files[p.name] = file_record(p)
        if COMPILED not in files:
            raise GraphCacheError(f"graph cache entry {self.root}: nothing compiled to commit")
        self._write_meta({"format": FORMAT, "key": self.key, "spec": asdict(spec) if hasattr(spec, "__dataclass_fields__") else spec,
                          "files": files, "versions": library_versions(), **(extra or {})})

    def _write_meta(self, meta: dict) -> None:
        with atomic_path(self.root / META) as tmp:
            tmp.write_text(json.dumps(meta, indent=1, default=str))

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.iterdir() if p.is_file()) if self.root.exists() else 0


STALE_STAGING_S = 3600.0  # a staging folder older than this belongs to a killed build


def _live_staging(d: Path) -> bool:
    """A `.build-*` folder young enough to belong to a build in progress (listed by no one)."""
    if not d.name.startswith(".build-"):
        return False
    try:
        return time.time() - d.stat().st_mtime < STALE_STAGING_S
    except OSError:
        return True


def _all_entries() -> list[tuple[str, CacheEntry, bool]]:
    """(backend folder, entry, of the current FORMAT and finished) for every entry on disk."""
    root = graphs_root()
    out = []
    for backend in sorted(p for p in root.iterdir() if p.is_dir() and p.name != ".locks") if root.exists() else []:
        for d in sorted(d for d in backend.iterdir() if d.is_dir() and not _live_staging(d)):
            try:
                current = json.loads((d / META).read_text()).get("format") == FORMAT
            except (OSError, ValueError):
                current = False
            out.append((backend.name, CacheEntry(d, d.name), current))
    return out


def cache_usage() -> dict[str, dict[str, int]]:
    """Per backend folder: entries of the current `FORMAT`, entries of older formats or unfinished, bytes."""
    root = graphs_root()
    out = {p.name: {"entries": 0, "other": 0, "bytes": 0}
           for p in (sorted(p for p in root.iterdir() if p.is_dir() and p.name != ".locks") if root.exists() else [])}
    for backend, entry, current in _all_entries():
        row = out[backend]
        row["entries" if current else "other"] += 1
        row["bytes"] += entry.size_bytes()
    return out


def clear_cache(only_stale: bool = False) -> int:
    """Delete graph cache entries (all, or only those of older formats / unfinished); returns bytes freed."""
    freed = 0
    for _, entry, current in _all_entries():
        if not (only_stale and current):
            freed += entry.size_bytes()
            entry.discard()
    return freed
