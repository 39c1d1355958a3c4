"""Where hetero keeps what it derives (model caches, graphs, calibration), how it names it, and how it
knows an entry is intact (content records, `verify`) and degrades when it cannot write (`cached`).

Every cache entry carries a content record of its files (size + xxh3-128 of the whole file, written
after the file is in place, under the entry's lock). A process checks a file in full the first time it
uses it (never trusting stat stamps: bit rot and `cp -p` keep them); later checks in the same process
reuse that hash while the file's stat identity (inode, size, mtime, ctime) is unchanged. A check that
fails rebuilds the entry with one warning; a cache that cannot be written (read-only, full disk) runs
uncached with one warning. Cost: docs/journal.md, "Cache integrity".
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import io
import logging
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import xxhash
from filelock import FileLock, Timeout

from hetero.errors import ConfigError, ModelFormatError

log = logging.getLogger(__name__)
T = TypeVar("T")


# Device profiles shipped with the package (read-only package data, `hetero/profiles/`); tables of
# equivalent shapes (§4, optimisation 1) sit in its `shapes/` subfolder. What a user measures on their
# host goes to `user_profiles_dir()`, never into the installed package.
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


def _cache_root() -> str:
    return os.environ.get("HETERO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hetero")


def cache_location() -> Path:
    """Where the user cache is (`cache_dir`), without creating it (`hetero cache verify` creates nothing)."""
    return Path(_cache_root())


def cache_dir() -> Path:
    """The user cache: `$HETERO_CACHE`, else `~/.cache/hetero`. ConfigError if it cannot be created."""
    root = _cache_root()
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cache folder {root!r} (HETERO_CACHE or ~/.cache/hetero) cannot be created: "
                          f"{e.strerror or e}; set HETERO_CACHE to a writable folder") from e
    return path


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
    """The content hash naming a model file's cache entries, 16 hex digits: `content_hash` of the whole file
    (the read that names the file also checks it), or for files over 1 GiB xxh3 of the size and the head
    and tail 64 MiB (to stay fast)."""
    p = Path(path)
    size = p.stat().st_size
    if size <= 16 * _SAMPLE:
        return content_hash(p)[:16]
    h = xxhash.xxh3_128(str(size).encode())
    with p.open("rb") as f:
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


# ---------------------------------------------------------------------------------- content records

RECORD = "record.json"  # an entry folder's content record: {"version": 1, "files": {name: record}}
RECORD_VERSION = 1
_BLOCK = 4 << 20  # read size of `content_hash` (measured: docs/journal.md, "Cache integrity")
_RACY_NS = 2_000_000_000  # a hash is remembered only for a file unchanged this long before it was read
_HASHED: dict[tuple[int, ...], str] = {}  # stat identity -> content hash, of files hashed in this process
_HASHED_LOCK = threading.Lock()


def content_hash(path: str | os.PathLike) -> str:
    """xxh3-128 (hex) of the whole file, read in blocks: ~10x sha256's speed, enough to catch damage (not
    an adversary who can write the cache). Hashed once per process while the file's stat identity (device,
    inode, size, mtime, ctime) is unchanged: a rewrite, a rename over it or `os.utime` changes it. As in
    git's index, a file changed within `_RACY_NS` of the read is not remembered (coarse clocks could give
    a second change in the same tick the same stamps)."""
    t0 = time.time_ns()
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with _HASHED_LOCK:
            known = _HASHED.get(key)
        if known is not None:
            return known
        digest = _hash_open_file(f, st.st_size)
    if t0 - max(st.st_mtime_ns, st.st_ctime_ns) > _RACY_NS:
        with _HASHED_LOCK:
            _HASHED[key] = digest
    return digest


_MAP_WINDOW = 64 << 20  # a multiple of mmap.ALLOCATIONGRANULARITY


def _hash_open_file(f: "io.FileIO", size: int) -> str:
    """xxh3-128 of an open file: hashed in place in populated read-only mappings of its page cache (4x faster
    than reading it into a buffer: 25 vs 107 ms for 513 MB), a window of `_MAP_WINDOW` bytes at a time (a mapped
    page counts in the process's resident memory while mapped: the whole float weights file mapped at once was a
    warm start's peak RSS, 711 MB against 279 after set-up), in blocks where it cannot be mapped."""
    h = xxhash.xxh3_128()
    try:
        for off in range(0, max(size, 1), _MAP_WINDOW):
            with mmap.mmap(f.fileno(), min(_MAP_WINDOW, size - off), offset=off, prot=mmap.PROT_READ,
                           flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as m:
                h.update(m)
        return h.hexdigest()
    except (OSError, ValueError, AttributeError):  # empty file, no mmap here (a pipe, another OS)
        h.reset()
        f.seek(0)
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    while n := f.readinto(buf):
        h.update(view[:n])
    return h.hexdigest()


def file_record(path: str | os.PathLike) -> dict:
    """What `verify_files` checks a file against later: its size and content hash."""
    return {"size": os.stat(path).st_size, "xxh3": content_hash(path)}


@dataclass(frozen=True, slots=True)
class Damage:
    """One file of an entry that fails its check, and why."""

    name: str
    why: str

    def __str__(self) -> str:
        return f"{self.name} {self.why}"


def verify_files(root: Path, files: dict[str, dict]) -> list[Damage]:
    """The files under `root` that do not match their `file_record`s (missing, other size, other content
    hash, or a record without a hash); [] when all match. Every file is hashed in full (`content_hash`)."""
    bad = []
    for name, rec in files.items():
        p = root / name
        try:
            size = p.stat().st_size if p.is_file() else None
        except OSError:
            size = None
        if size is None:
            bad.append(Damage(name, "is missing"))
        elif size != rec.get("size"):
            bad.append(Damage(name, f"has {size} bytes, its record {rec.get('size')} (truncated or replaced)"))
        elif not isinstance(rec.get("xxh3"), str):
            bad.append(Damage(name, "has no content hash in its record (an older cache format)"))
        else:
            try:
                if content_hash(p) != rec["xxh3"]:
                    bad.append(Damage(name, "fails its content hash (corrupt)"))
            except OSError as e:
                bad.append(Damage(name, f"cannot be read ({e.strerror or e})"))
    return bad


def read_record(entry: Path) -> dict[str, dict]:
    """{name: record} of the files recorded in `entry`/record.json; {} when there is none. ValueError if
    the record itself is unreadable (damaged)."""
    try:
        data = json.loads((entry / RECORD).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{RECORD} is unreadable ({e})") from e
    if not isinstance(data, dict) or data.get("version") != RECORD_VERSION or not isinstance(data.get("files"), dict):
        raise ValueError(f"{RECORD} is not a version-{RECORD_VERSION} record")
    return data["files"]


def _write_record_files(entry: Path, files: dict[str, dict]) -> None:
    with atomic_path(entry / RECORD) as tmp:
        tmp.write_text(json.dumps({"version": RECORD_VERSION, "files": files}, indent=1, sort_keys=True))


def write_record(entry: Path, names: Iterable[str]) -> None:
    """Record the content of files `names` (already in place, e.g. by `atomic_path`) in `entry`/record.json,
    beside what it records already. Call holding `entry_lock(entry)`. OSError if it cannot be written."""
    try:
        files = read_record(entry)
    except ValueError:  # a damaged record: start it anew (its other files then fail their check)
        files = {}
    files.update({n: file_record(entry / n) for n in names})
    _write_record_files(entry, files)


def forget(entry: Path, names: Iterable[str]) -> None:
    """Delete files `names` of `entry` and their records (holding `entry_lock(entry)`): nothing half-built
    or damaged stays behind. Best effort: a file that cannot be removed fails its check later."""
    names = list(names)
    for n in names:
        with contextlib.suppress(OSError):
            (entry / n).unlink(missing_ok=True)
    try:
        files = read_record(entry)
        if any(n in files for n in names):
            _write_record_files(entry, {k: v for k, v in files.items() if k not in names})
    except (OSError, ValueError):
        pass


def verify(entry: Path, names: Iterable[str] | None = None) -> list[Damage]:
    """The files of `entry` (`names`, default every recorded one) failing their check against
    `entry`/record.json: missing, unrecorded, or of other size or content. [] when all are intact."""
    try:
        files = read_record(entry)
    except ValueError as e:
        return [Damage(n, f"cannot be checked: {e}") for n in (names if names is not None else [RECORD])]
    if names is None:
        return verify_files(entry, files)
    names = list(names)
    return ([Damage(n, "has no content record") for n in names if n not in files]
            + verify_files(entry, {n: files[n] for n in names if n in files}))


_LOCKS: dict[str, FileLock] = {}


def entry_lock(entry: Path) -> FileLock:
    """The inter-process lock of cache entry folder `entry` (a file in `entry.parent/.locks/`, apart from
    the entries): hold it to build, repair or record the entry. One object per path in a process, so a
    thread may take it again (re-entrant). OSError if the lock file cannot be created (read-only cache)."""
    locks = entry.parent / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    path = str(locks / f"{entry.name}.lock")
    lock = _LOCKS.get(path)
    if lock is None:
        lock = _LOCKS.setdefault(path, FileLock(path))
    return lock


_WARNED: set[str] = set()


def warn_once(tag: str, msg: str, *args: object) -> None:
    """log.warning(msg, *args) the first time this process meets `tag`; later ones go to the debug log."""
    if tag in _WARNED:
        log.debug(msg, *args)
    else:
        _WARNED.add(tag)
        log.warning(msg, *args)


def cache_unwritable(where: Path, e: BaseException) -> None:
    """The one warning of a process that cannot write its cache (read-only, full disk): it runs uncached."""
    why = getattr(e, "strerror", None) or str(e) or type(e).__name__
    root = _cache_root()
    tag = root if str(Path(where).resolve()).startswith(str(Path(root).resolve())) else str(where)
    warn_once(f"unwritable:{tag}", "cannot write the cache at %s (%s); running uncached: what it would keep "
              "is computed again each run", where, why)


def write_error(e: BaseException) -> OSError:
    """An OSError for a failed cache write reported by a library as another type (safetensors'
    SafetensorError on a full disk), so callers catch one type: re-raise the result `from e`."""
    return e if isinstance(e, OSError) else OSError(str(e))


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc (musl, macOS, Windows): nothing to call
        return None


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim(0)`; a no-op on other C libraries).
    glibc keeps what a set-up step freed (its float arrays, once freed, raise the threshold under which later ones
    come from the heap rather than their own mapping) for the life of the process: 0.55 GB of RssAnon after
    calibrating the 4-layer llama-3.2-1b, which no later step reused."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def cached(entry: Path, name: str, load: Callable[[Path], T], build: Callable[[], T],
           save: Callable[[T, Path], None], what: str, timeout_s: float = 3600.0) -> T:
    """`what`, kept as file `name` of cache entry folder `entry`: loaded when it verifies against the entry's
    record and `load` accepts it; else built once under the entry's lock (a process that waited loads what
    the other built), saved atomically (`save(value, temp path)`) and recorded.

    A file that fails its check is rebuilt with one warning; a cache that cannot be written (read-only, full
    disk) costs one warning per process and an uncached build, leaving no partial file. `load` may raise
    anything for content it refuses (older format, wrong model): that counts as a failed check.
    """
    path = entry / name
    found, value, why = _load_checked(entry, name, load)  # the common case: no lock taken
    if found:
        return value
    try:
        lock = entry_lock(entry)
        lock.acquire(timeout=timeout_s)
    except (OSError, Timeout) as e:  # read-only cache (or a stuck writer): build for this run only
        if why is not None:
            log.warning("%s %s %s; computing it for this run", what, path, why)
        cache_unwritable(entry, e)
        return build()
    try:
        found, value, why = _load_checked(entry, name, load)  # another process may have built it meanwhile
        if found:
            return value
        if why is not None:
            log.warning("%s %s %s; rebuilding it", what, path, why)
        value = build()
        keep(entry, name, value, save)
        trim_heap()  # what building it freed (rotation's, calibration's float arrays)
        return value
    finally:
        lock.release()


def keep(entry: Path, name: str, value: T, save: Callable[[T, Path], None]) -> bool:
    """Save `value` as file `name` of cache entry `entry` (`save(value, temp path)`, renamed into place)
    and record it, under the entry's lock; False, with the one unwritable-cache warning and no partial
    file left, when the cache cannot take it (read-only, full disk)."""
    try:
        with entry_lock(entry):
            try:
                with atomic_path(entry / name) as tmp:
                    try:
                        save(value, tmp)
                    except ModelFormatError:  # what it writes is refused (a weight not finite): an error, not a cache
                        raise                 # that cannot write
                    except Exception as e:
                        raise write_error(e) from e
                write_record(entry, [name])
            except (OSError, ModelFormatError):
                forget(entry, [name])
                with contextlib.suppress(OSError):
                    entry.rmdir()  # if this file was all it held: no empty entry stays
                raise
    except (OSError, Timeout) as e:
        cache_unwritable(entry, e)
        return False
    return True


def _load_checked(entry: Path, name: str, load: Callable[[Path], T]) -> tuple[bool, T | None, str | None]:
    """(True, value, None) for a file that verifies and loads; (False, None, why) for one that does not;
    (False, None, None) when there is none."""
    if not (entry / name).exists():
        return False, None, None
    bad = verify(entry, [name])
    if bad:
        return False, None, "; ".join(d.why for d in bad)
    try:
        return True, load(entry / name), None
    except Exception as e:  # verified bytes a reader refuses (an older format): rebuilt, never trusted
        return False, None, f"cannot be read ({type(e).__name__}: {e})"
