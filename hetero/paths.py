"""Where hetero keeps what it derives (model caches, graphs, calibration) and how it names it."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


# Device profiles shipped with the source tree (docs/design.md: `profiles/`); tables of equivalent shapes
# (§4, optimisation 1) sit in its `shapes/` subfolder.
PROFILES_DIR = Path(__file__).resolve().parents[1] / "profiles"


def cache_dir() -> Path:
    """The user cache: `$HETERO_CACHE`, else `~/.cache/hetero`."""
    root = os.environ.get("HETERO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hetero")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


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
