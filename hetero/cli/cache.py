"""`hetero cache verify`: re-hash every entry of the user cache, remove the damaged ones, say which.

Each entry is checked as a run checks it at first use (`hetero.paths`: size and content hash of every file
against its record), under the entry's lock: the default model's GGUF, the float model copies
(`models/<fingerprint>/`), the files recorded in `record.json` folders (rotated copies, calibrations,
precision plans, hot-channel stores, learned profiles) and the graph entries (`graphs/`). A damaged entry
is removed, so that the next run rebuilds it; a file a cache folder holds without a record (an older
cache format) too. A read-only cache is only checked.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from filelock import Timeout

from hetero.cli import add_command


@dataclass(frozen=True, slots=True)
class Finding:
    """One damaged entry (or file of an entry): where, why, and whether it was removed."""

    path: str
    why: str
    repaired: bool


def cmd_verify(args: argparse.Namespace) -> int:
    from hetero.paths import cache_location

    root = cache_location()
    if not root.is_dir():  # nothing to check, and nothing created
        print(json.dumps({"root": str(root), "checked": 0, "seconds": 0.0, "damaged": []}, indent=1) if args.json else
              f"nothing to verify: there is no cache at {root} (HETERO_CACHE, else ~/.cache/hetero)")
        return 0
    t0 = time.perf_counter()
    checked, findings = verify_cache(root)
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"root": str(root), "checked": checked, "seconds": round(seconds, 2),
                          "damaged": [asdict(f) for f in findings]}, indent=1))
    else:
        print(f"checked {checked} cache entries under {root} in {seconds:.1f} s: "
              f"{'all intact' if not findings else f'{len(findings)} damaged'}")
        for f in findings:
            what = "removed (rebuilt at next use)" if f.repaired else "NOT repaired (the cache cannot be written)"
            print(f"  {f.path}: {f.why}; {what}")
    return 1 if any(not f.repaired for f in findings) else 0


def verify_cache(root: Path) -> tuple[int, list[Finding]]:
    """(entries checked, damaged ones) of the cache at `root`; damaged entries are removed where possible."""
    checked, findings = 0, []
    models = root / "models"
    gguf_n, gguf_f = _default_gguf(models)
    checked, findings = checked + gguf_n, findings + gguf_f
    for d in _folders(models):
        n, f = _model_folder(d)
        checked, findings = checked + n, findings + f
    learned = root / "profiles" / "learned"  # only what runs learn: measured profiles and shape tables are the user's
    if learned.is_dir():
        n, f = _recorded_files(learned, exclude=())
        checked, findings = checked + n, findings + f
    n, f = _graphs()
    return checked + n, findings + f


def _folders(parent: Path) -> list[Path]:
    return sorted(d for d in parent.iterdir() if d.is_dir() and not d.name.startswith(".")) if parent.is_dir() else []


def _locked(lock: Any, repair: Any) -> bool:
    """Run `repair()` holding `lock`; False if the lock cannot be taken (a read-only cache)."""
    try:
        with lock:
            repair()
    except (OSError, Timeout):
        return False
    return True


def _default_gguf(models: Path) -> tuple[int, list[Finding]]:
    from hetero.default_model import GGUF_NAME, cached_copy_intact
    from hetero.paths import entry_lock

    path = models / GGUF_NAME
    if not path.exists():
        return 0, []
    if cached_copy_intact(path):
        return 1, []

    def repair() -> None:
        if not cached_copy_intact(path):
            path.unlink(missing_ok=True)

    try:
        ok = _locked(entry_lock(path), repair)
    except OSError:
        ok = False
    return 1, [Finding(str(path), "fails its known content hash", ok)]


def _model_folder(d: Path) -> tuple[int, list[Finding]]:
    """A `models/` folder: the loader's entry (meta.json) if any, and the files recorded beside it."""
    from hetero.loader import ENTRY_FILES, check_entry, discard_entry
    from hetero.paths import entry_lock

    checked, findings = 0, []
    if (d / "meta.json").exists():
        checked += 1
        why = check_entry(d)
        if why is not None:
            try:
                ok = _locked(entry_lock(d), lambda: check_entry(d) is not None and discard_entry(d))
            except OSError:
                ok = False
            findings.append(Finding(str(d), why, ok))
    if not d.is_dir():  # removed whole: it held nothing else
        return checked, findings
    n, f = _recorded_files(d, exclude=ENTRY_FILES if (d / "meta.json").exists() else ())
    return checked + n, findings + f


def _recorded_files(d: Path, exclude: tuple[str, ...]) -> tuple[int, list[Finding]]:
    """The files of folder `d` checked against its record.json (a file without a record counts as damaged)."""
    from hetero.paths import RECORD, entry_lock, forget, read_record, verify

    try:
        recorded = set(read_record(d))
    except ValueError:
        recorded = set()
    present = {p.name for p in d.iterdir() if p.is_file() and not p.name.startswith(".") and p.suffix != ".lock"} - {RECORD}
    names = sorted((present | recorded) - set(exclude))
    bad = verify(d, names) if names else []
    findings = []
    for damage in bad:
        def repair(name: str = damage.name) -> None:
            if verify(d, [name]):
                forget(d, [name])

        try:
            ok = _locked(entry_lock(d), repair)
        except OSError:
            ok = False
        findings.append(Finding(str(d / damage.name), damage.why, ok))
    return len(names), findings


def _graphs() -> tuple[int, list[Finding]]:
    from hetero.errors import GraphCacheError
    from hetero.npu.cache import CacheEntry, graphs_root

    root, checked, findings = graphs_root(), 0, []
    for backend in _folders(root):
        for d in _folders(backend):  # `.build-*` staging folders and `.locks` are hidden
            checked += 1
            entry = CacheEntry(d, d.name)
            try:
                entry.read_compiled()
                continue
            except GraphCacheError as e:
                why = str(e).removeprefix(f"graph cache entry {d}: ")

            def repair(entry: CacheEntry = entry) -> None:
                try:
                    entry.read_compiled()
                except GraphCacheError:
                    shutil.rmtree(entry.root, ignore_errors=True)

            try:
                ok = _locked(entry.lock(timeout_s=60), repair)
            except OSError:
                ok = False
            findings.append(Finding(str(d), why, ok and not d.exists()))
    return checked, findings


def register(sub: Any) -> None:
    cache = add_command(sub, "cache")
    cs = cache.add_subparsers(dest="cache_command", required=True)
    v = cs.add_parser("verify", help="re-hash every cache entry, remove damaged ones (rebuilt at next use), list them")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_verify)
