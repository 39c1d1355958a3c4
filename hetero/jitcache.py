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
import subprocess
import sys
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


_CHILD = "HETERO_JIT_CHILD"


def compile_apart(module: str, function: str) -> None:
    """Have a child process run `module.function()` first, once per cache folder, so that it compiles the kernels
    that call makes into the cache and this process loads them. numba emits the cached object code apart from its
    JIT's, and under fastmath's reassociation the two round differently: the process that compiled the decode
    attention decoded other logits than every later one (`decode.rowattn.attend_entry`; without reassociation they
    agree, but a decode step lost ~20%: 84-95 against 107-115 tokens/s at context 1024, AMD EPYC Zen 4). Where the
    folder cannot be written every process compiles, and all of them agree."""
    folder = cache_dir()
    marker = os.path.join(folder, f"{module}.{function}.compiled")
    if os.environ.get(_CHILD) or os.path.exists(marker):
        return
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return
    if not os.access(folder, os.W_OK):
        return
    code = f"import importlib; getattr(importlib.import_module({module!r}), {function!r})()"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, _CHILD: "1"}, capture_output=True)
    if done.returncode == 0:
        tmp = f"{marker}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{module}.{function} compiled by a child process\n")
        os.replace(tmp, marker)
