"""Package data that a first run reads instead of computing: the default model's calibration and quantization
plans, which are the same on every machine (a cold start should not spend ~30-40 s calibrating).

Each kind of data is a folder of `hetero/data/` with a `manifest.json`, {key: {"file": name, "xxh3": hash, ...}}.
A shipped file is used only when its content hash matches the manifest's (an installation damaged on disk
computes instead, with a warning); `ship` writes a file and its manifest entry atomically (`make ship`,
`hetero.methods.ship_default_plans`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from hetero.paths import atomic_path, content_hash

log = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parent / "data"


def manifest(kind: str) -> dict[str, dict]:
    """The manifest of `hetero/data/<kind>/` ({} when there is none; a warning when it is unreadable)."""
    path = DATA / kind / "manifest.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring the shipped %s data (%s: %s)", kind, path, e)
        return {}


def verified(kind: str, entry: dict) -> Path | None:
    """The file a manifest entry of `kind` names, when its content hash is the recorded one; else None (warned)."""
    name = entry.get("file") if isinstance(entry, dict) else None
    path = DATA / kind / str(name)
    if not isinstance(name, str) or not path.is_file() or content_hash(path) != entry.get("xxh3"):
        log.warning("the shipped %s file %s fails its content hash: computing it instead", kind, path)
        return None
    return path


def ship(kind: str, key: str, source: Path, keep: set[str] | None = None, **fields: object) -> None:
    """Copy `source` into `hetero/data/<kind>/` under its own name and record it in the manifest under `key`
    (with `fields`). keep: when given, the keys whose entries stay; every other entry, and every file no entry
    names, is removed (a regenerated folder holds only what the current code reads)."""
    folder = DATA / kind
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / source.name) as tmp:
        shutil.copyfile(source, tmp)
    entries = manifest(kind)
    entries[key] = {**fields, "file": source.name, "xxh3": content_hash(folder / source.name)}
    if keep is not None:
        entries = {k: e for k, e in entries.items() if k in keep or k == key}
    with atomic_path(folder / "manifest.json") as tmp:
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    if keep is not None:  # after the manifest: it never names a removed file
        named = {e["file"] for e in entries.values()} | {"manifest.json"}
        for f in folder.iterdir():
            if f.is_file() and f.name not in named:
                f.unlink()
