"""hetero's own C kernels: compiled once per host with the host's C compiler into the user cache, verified before
each load.

A kernel's shared library is keyed by its source and flags (`<cache>/native/<key>/<name>.so`), built under the
entry's lock and checked against its content record before every process loads it (`paths.cached`: a damaged
file is rebuilt with a warning); where the cache cannot be written the process loads its own build from a
temporary file. Where a kernel cannot run (the CPU lacks an instruction set it needs, there is no compiler, the
build fails) `Kernel.unavailable` says why in one line and the caller keeps its other path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hetero.errors import ConfigError
from hetero.paths import cache_dir, cached

HERE = Path(__file__).resolve().parent


def compiler() -> str | None:
    """The C compiler to build with: `$CC`, else gcc, else cc (None when there is none)."""
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return name
    return None


@dataclass(frozen=True)
class Kernel:
    """A C source of this package (`source`, a file name here), built with `flags` into `<name>.so`; `needs`: the
    /proc/cpuinfo flags its instructions need; `what`: its name in messages; `setup`: declares the library's
    functions (argtypes, restype) once it is loaded; `headers`: the package's headers it includes (in its key)."""

    source: str
    flags: tuple[str, ...]
    needs: tuple[str, ...]
    what: str
    setup: Callable[[ctypes.CDLL], None] = field(compare=False, hash=False)
    headers: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return HERE / self.source

    @property
    def name(self) -> str:
        return Path(self.source).stem + ".so"

    def key(self) -> str:
        sources = b"".join((HERE / name).read_bytes() for name in (self.source, *self.headers))
        return hashlib.sha256(sources + "\0".join(self.flags).encode()).hexdigest()[:24]

    def unavailable(self, load: Callable[[], object] | None = None) -> str | None:
        """None when the kernel can be loaded on this host (building it once), else why not (one line). load: the
        caller's cached loader (`functools.cache` of `load`), so a check does not load the library again."""
        from hetero.cpu import cpu_flags

        missing = [f for f in self.needs if f not in cpu_flags()]
        if missing:
            return f"this CPU lacks {', '.join(missing)}"
        missing = [p for p in (self.path, *(HERE / h for h in self.headers)) if not p.is_file()]
        if missing:
            return f"its source {missing[0]} is not installed"
        if compiler() is None:
            return "no C compiler (gcc or cc, or $CC) to build the kernel with"
        try:
            (load or self.load)()
        except ConfigError as e:
            return str(e)
        return None

    def _compile(self) -> bytes:
        cc = compiler()
        if cc is None:
            raise ConfigError(f"no C compiler (gcc or cc, or $CC) to build {self.what} with")
        with tempfile.TemporaryDirectory(prefix="hetero-cc-") as tmp:
            out = Path(tmp) / self.name
            r = subprocess.run([cc, *self.flags, "-o", str(out), str(self.path)], capture_output=True, text=True)
            if r.returncode != 0:
                raise ConfigError(f"{cc} could not build {self.what}: {r.stderr.strip()[-400:]}")
            return out.read_bytes()

    def load(self) -> ctypes.CDLL:
        """The compiled library, built once per host into `<cache>/native/<key>/` and verified before loading (a
        ctypes call into it releases the GIL). Callers keep the result (`functools.cache`): a library loads once."""
        return self.load_with_path()[0]

    def load_with_path(self) -> tuple[ctypes.CDLL, str]:
        """`load`, and the file it loaded (what ONNX Runtime opens to register a library of ops, `ort_ops`)."""
        entry = cache_dir() / "native" / self.key()
        data = cached(entry, self.name, lambda p: p.read_bytes(), self._compile, lambda b, p: p.write_bytes(b),
                      self.what)
        path = entry / self.name
        if not path.is_file() or path.read_bytes() != data:  # an unwritable cache: load this run's build
            fd, tmp = tempfile.mkstemp(prefix="hetero-native-", suffix=".so")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            path = Path(tmp)
        lib = ctypes.CDLL(str(path))
        self.setup(lib)
        return lib, str(path)
