"""numba's on-disk cache of hetero's compiled kernels, in a folder named by the content of their sources.

numba keys a cached kernel by the stamp (mtime, size) of the one file that defines it. A kernel that compiles in
another file's functions (`decode.twocore.attnpool` inlines `decode.rowattn`'s) would load a stale compile
after that other file alone changed: a silent wrong answer. Every kernel is therefore cached (`njit`) under
`<hetero>/__pycache__/numba-<digest>` (or `$NUMBA_CACHE_DIR/hetero-<digest>`), the digest a sha256 of every
module that compiles numba code (`KERNEL_SOURCES`): any edit to any of them gives new folders and a recompile.
Where that folder cannot be written, numba falls back to its own locations (an installed package's files do
not change in place).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba

ROOT = Path(__file__).resolve().parent
# every module of hetero that compiles numba code or defines what it calls: the users of `njit` and the modules
# importing numba (tests/test_jitcache.py keeps the list complete)
KERNEL_SOURCES = ("decode/rowattn.py", "decode/head.py", "decode/twocore/attnpool.py", "decode/twocore/atomics.py",
                  "decode/twocore/native.py", "outliers/rangecheck.py")


def digest(root: Path = ROOT) -> str:
    """sha256 over the kernel sources under `root` (names and contents), 16 hex digits."""
    h = hashlib.sha256()
    for rel in KERNEL_SOURCES:
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_dir() -> str:
    user = os.environ.get("NUMBA_CACHE_DIR")
    return os.path.join(user, f"hetero-{DIGEST}") if user else str(ROOT / "__pycache__" / f"numba-{DIGEST}")


DIGEST = digest()


def _cached(decorator: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
    """`decorator` applied with its cache in `cache_dir()`: numba picks a kernel's cache folder when it decorates,
    so the setting is held only for that moment (other numba users keep theirs)."""
    def decorate(fn: Callable) -> Callable:
        before = numba.config.CACHE_DIR
        numba.config.CACHE_DIR = cache_dir()
        try:
            return decorator(fn)
        finally:
            numba.config.CACHE_DIR = before

    return decorate


def njit(**options: Any) -> Callable:
    """`numba.njit(cache=True, **options)` cached in `cache_dir()`."""
    return _cached(numba.njit(cache=True, **options))


def cfunc(signature: Any, **options: Any) -> Callable:
    """`numba.cfunc(signature, cache=True, **options)` cached in `cache_dir()`: a kernel compiled once, as one C
    function, whose address every caller calls (numba inlines an njit kernel into each caller and optimizes each
    copy on its own, so with fastmath two callers' copies can round differently: `decode.rowattn.attend`)."""
    return _cached(numba.cfunc(signature, cache=True, **options))
