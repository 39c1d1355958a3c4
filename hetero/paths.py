"""Where hetero keeps what it derives (model caches, graphs, calibration) and how it names it."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from hetero.errors import ConfigError


# Device profiles shipped with the package (read-only package data, `hetero/profiles/`); tables of
# equivalent shapes (§4, optimisation 1) sit in its `shapes/` subfolder. What a user measures on their
# host goes to `user_profiles_dir()`, never into the installed package.
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


def cache_dir() -> Path:
    """The user cache: `$HETERO_CACHE`, else `~/.cache/hetero`. ConfigError if it cannot be created."""
    root = os.environ.get("HETERO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hetero")
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cache folder {root!r} (HETERO_CACHE or ~/.cache/hetero) cannot be created: "
                          f"{e.strerror or e}; set HETERO_CACHE to a writable folder") from e
    return path


def sha256_file(path: str | os.PathLike) -> str:
    """sha256 of a whole file, read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_record(path: str | os.PathLike) -> dict:
    """What `check_files` verifies a file against later: size, sha256 and stat stamp (mtime_ns)."""
    st = os.stat(path)
    return {"size": st.st_size, "sha256": sha256_file(path), "mtime_ns": st.st_mtime_ns}


def check_files(root: Path, files: dict[str, dict], full: bool = False) -> tuple[str | None, bool]:
    """Verify files under `root` against their `file_record`s, git-index style: a size mismatch fails at
    once; a file whose stat stamp moved (or every file, `full`) is hashed and must match its sha256, and its
    record's stamp is refreshed in place. Returns (why it fails or None, whether a stamp was refreshed)."""
    for name, info in files.items():
        p = root / name
        if not p.is_file() or p.stat().st_size != info["size"]:
            return f"{name} missing or truncated", False
    restamped = False
    for name, info in files.items():
        p = root / name
        stamp = p.stat().st_mtime_ns
        if not full and stamp == info.get("mtime_ns"):
            continue
        if sha256_file(p) != info["sha256"]:
            return f"{name} fails its sha256 (corrupt)", restamped
        info["mtime_ns"], restamped = stamp, True
    return None, restamped


def check_writable(path: str | os.PathLike, what: str) -> Path:
    """ConfigError (naming `what`) unless a file can be written at `path`: checked before long work."""
    p = Path(path)
    try:
        with atomic_path(p.with_name(p.name + ".probe")) as tmp:
            tmp.write_bytes(b"")
        p.with_name(p.name + ".probe").unlink()
    except OSError as e:
        raise ConfigError(f"{what} {str(p)!r} cannot be written: {e.strerror or e}") from e
    return p


STALE_TEMP_S = 3600.0  # a temp file of `atomic_path` older than this belongs to a killed writer


def remove_stale_temps(folder: Path, older_than_s: float = STALE_TEMP_S) -> int:
    """Delete `atomic_path` temp files (`.<name>.*.tmp`) in `folder` older than `older_than_s`; call it
    holding the folder's lock. Returns the bytes freed."""
    freed, now = 0, time.time()
    for p in folder.glob(".*.tmp") if folder.is_dir() else []:
        try:
            st = p.stat()
            if now - st.st_mtime > older_than_s:
                p.unlink()
                freed += st.st_size
        except OSError:
            continue
    return freed


def user_profiles_dir() -> Path:
    """Where profiles measured on this host are written (and read first): `cache_dir()/profiles`."""
    return cache_dir() / "profiles"


def profile_search_path() -> list[Path]:
    """Folders holding profiles, the user's measured ones first, then those shipped with the package."""
    return [user_profiles_dir(), PROFILES_DIR]


_SAMPLE = 64 << 20


def file_fingerprint(path: str | os.PathLike) -> str:
    """sha256 of a file (size + head and tail 64 MiB for files over 1 GiB, to stay fast), 16 hex digits."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with p.open("rb") as f:
        if size <= 16 * _SAMPLE:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(f.read(_SAMPLE))
            f.seek(size - _SAMPLE)
            h.update(f.read(_SAMPLE))
    return h.hexdigest()[:16]


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success rename it over `target`, else delete it.

    Nothing is ever left half-written under the final name.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, target)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()
