"""Contexts that survive a restart (llama.cpp server's slot save/restore, LLMS's persistent contexts).

A saved context is two files in the state folder: `<id>.kv.safetensors` (its K/V, [L, n_kv, n, D] for the
first n of its token ids) and `<id>.json`, the commit record: messages, ids, owner, the key its K/V is valid
for (model fingerprint, method) and the K/V file's `paths.file_record` (size, content hash). Both are written
atomically (temp + rename), the K/V first, so a record never names a half-written file, under the
context's lock (`.<id>.lock`: two servers sharing the folder never mix one's record with the other's K/V). A restore checks
the key and re-hashes the K/V file (`paths.verify_files`, in full): a context whose K/V fails keeps its
messages and ids, with one warning, and its next turn recomputes the K/V (nothing unverified is used).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock
from safetensors.numpy import load_file, save_file

from hetero.paths import atomic_path, file_record, verify_files

log = logging.getLogger(__name__)
FORMAT = 1


@dataclass(frozen=True, slots=True)
class SavedContext:
    id: str
    client: str
    system: str | None
    messages: list[dict]
    ids: list[int]
    created: float
    k: np.ndarray | None  # float32 K/V of ids[:n]; None when they failed verification (recomputed later)
    v: np.ndarray | None


def _names(folder: Path, cid: str) -> tuple[Path, Path]:
    return folder / f"{cid}.json", folder / f"{cid}.kv.safetensors"


def _lock(folder: Path, cid: str) -> FileLock:
    return FileLock(str(folder / f".{cid}.lock"), timeout=60)


def save(folder: Path, key: dict, ctx: SavedContext) -> Path:
    """Write one context (K/V, then its record); returns the record's path."""
    folder.mkdir(parents=True, exist_ok=True)
    record, kv = _names(folder, ctx.id)
    with _lock(folder, ctx.id):
        files = {}
        if ctx.k is not None and ctx.k.shape[2]:
            with atomic_path(kv) as tmp:
                save_file({"k": np.ascontiguousarray(ctx.k), "v": np.ascontiguousarray(ctx.v)}, str(tmp))
            files[kv.name] = file_record(kv)
        else:
            kv.unlink(missing_ok=True)
        meta = {"format": FORMAT, "key": key, "id": ctx.id, "client": ctx.client, "system": ctx.system,
                "messages": ctx.messages, "ids": ctx.ids, "created": ctx.created,
                "kv_tokens": int(ctx.k.shape[2]) if files else 0, "files": files}
        with atomic_path(record) as tmp:
            tmp.write_text(json.dumps(meta))
    return record


def remove(folder: Path, cid: str) -> None:
    with _lock(folder, cid):
        for p in _names(folder, cid):
            p.unlink(missing_ok=True)
    (folder / f".{cid}.lock").unlink(missing_ok=True)


def load_all(folder: Path, key: dict) -> list[SavedContext]:
    """Every saved context of `folder` valid for `key`; unreadable records are skipped with a warning."""
    out = []
    for record in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        with _lock(folder, record.name[: -len(".json")]):
            saved = _load_one(folder, record, key)
        if saved is not None:
            out.append(saved)
    return out


def _load_one(folder: Path, record: Path, key: dict) -> SavedContext | None:
    """One record and its verified K/V; None (with a warning) when unreadable or of another key."""
    try:
        meta = json.loads(record.read_text())
        if meta.get("format") != FORMAT or not isinstance(meta.get("ids"), list):
            raise ValueError("not a hetero context record")
    except (OSError, ValueError) as e:
        log.warning("saved context %s is unreadable (%s): skipped", record.name, e)
        return None
    if meta["key"] != key:
        log.warning("saved context %s belongs to %s, not this server's %s: skipped", meta["id"], meta["key"], key)
        return None
    k = v = None
    if meta["files"]:
        why = "; ".join(str(d) for d in verify_files(folder, meta["files"])) or None
        if why is None:
            try:
                t = load_file(str(folder / next(iter(meta["files"]))))
                k, v = t["k"], t["v"]
                if k.shape[2] != meta["kv_tokens"] or k.shape != v.shape:
                    raise ValueError(f"K/V holds {k.shape[2]} tokens, the record says {meta['kv_tokens']}")
            except (OSError, ValueError, KeyError) as e:
                why, k, v = f"{type(e).__name__}: {e}", None, None
        if why is not None:
            log.warning("saved context %s: its K/V fails verification (%s); its next turn recomputes it",
                        meta["id"], why)
    return SavedContext(meta["id"], meta["client"], meta["system"], meta["messages"],
                        [int(t) for t in meta["ids"]], float(meta["created"]), k, v)


def default_folder(model_fingerprint: str, method: str) -> Path:
    """`cache_dir()/serve/<fingerprint>-<method>`: saved contexts of one model and method."""
    from hetero.paths import cache_dir

    return cache_dir() / "serve" / f"{model_fingerprint[:16]}-{method}"

