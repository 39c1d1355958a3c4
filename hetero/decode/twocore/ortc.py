"""ONNX Runtime's C API through ctypes: sessions and IOBindings that compiled code can run without the GIL.

The onnxruntime wheel ships its C library (`capi/libonnxruntime.so.*`, exporting `OrtGetApiBase`) beside the
Python module, which links its own static copy; loading the library gives a second, independent runtime in
the process. A decode step's helper thread runs graph halves through it from numba (`native.call3` on
`run_fn` = RunWithBinding), with no GIL to hand over (~40 µs a hand-off, measured: docs/journal.md, "Decoding").

Only what the split decode graphs need (`halves`, `bound_step.BoundStep`): a session from a model in memory on one
thread without spinning or arena, as `npu.providers.OrtCpuProvider.load`, and a binding of its inputs and
outputs to fixed float32 buffers. Slots are positions in `struct OrtApi` (onnxruntime_c_api.h), append-only
across releases; the runtime's own static_asserts pin ReleaseCustomOpDomain at 101 and ReleaseModelMetadata
at 118, which the slots below agree with.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
import weakref
from ctypes import CFUNCTYPE, POINTER, byref, c_char_p, c_int, c_int64, c_size_t, c_uint32, c_void_p
from typing import TYPE_CHECKING

import numpy as np

from hetero.errors import BackendUnavailable

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)

_API_VERSION = 16  # every function used here exists since API version 5; 1.32 serves up to its own
_SLOTS = {"GetErrorMessage": 2, "CreateEnv": 3, "CreateSessionFromArray": 8, "CreateSessionOptions": 10,
          "DisableCpuMemArena": 19, "SetSessionGraphOptimizationLevel": 23, "SetIntraOpNumThreads": 24,
          "SetInterOpNumThreads": 25, "CreateTensorWithDataAsOrtValue": 49, "CreateCpuMemoryInfo": 69,
          "ReleaseEnv": 92, "ReleaseStatus": 93, "ReleaseMemoryInfo": 94, "ReleaseSession": 95, "ReleaseValue": 96,
          "ReleaseSessionOptions": 100, "AddSessionConfigEntry": 130, "RunWithBinding": 133, "CreateIoBinding": 134,
          "ReleaseIoBinding": 135, "BindInput": 136, "BindOutput": 137}
_STATUS = c_void_p
_PROTOS = {
    "GetErrorMessage": CFUNCTYPE(c_char_p, c_void_p),
    "CreateEnv": CFUNCTYPE(_STATUS, c_int, c_char_p, POINTER(c_void_p)),
    "CreateSessionFromArray": CFUNCTYPE(_STATUS, c_void_p, c_void_p, c_size_t, c_void_p, POINTER(c_void_p)),
    "CreateSessionOptions": CFUNCTYPE(_STATUS, POINTER(c_void_p)),
    "DisableCpuMemArena": CFUNCTYPE(_STATUS, c_void_p),
    "SetSessionGraphOptimizationLevel": CFUNCTYPE(_STATUS, c_void_p, c_int),
    "SetIntraOpNumThreads": CFUNCTYPE(_STATUS, c_void_p, c_int),
    "SetInterOpNumThreads": CFUNCTYPE(_STATUS, c_void_p, c_int),
    "CreateTensorWithDataAsOrtValue": CFUNCTYPE(_STATUS, c_void_p, c_void_p, c_size_t, POINTER(c_int64), c_size_t,
                                                c_int, POINTER(c_void_p)),
    "CreateCpuMemoryInfo": CFUNCTYPE(_STATUS, c_int, c_int, POINTER(c_void_p)),
    "ReleaseEnv": CFUNCTYPE(None, c_void_p), "ReleaseStatus": CFUNCTYPE(None, c_void_p),
    "ReleaseMemoryInfo": CFUNCTYPE(None, c_void_p), "ReleaseSession": CFUNCTYPE(None, c_void_p),
    "ReleaseValue": CFUNCTYPE(None, c_void_p), "ReleaseSessionOptions": CFUNCTYPE(None, c_void_p),
    "AddSessionConfigEntry": CFUNCTYPE(_STATUS, c_void_p, c_char_p, c_char_p),
    "RunWithBinding": CFUNCTYPE(_STATUS, c_void_p, c_void_p, c_void_p),
    "CreateIoBinding": CFUNCTYPE(_STATUS, c_void_p, POINTER(c_void_p)),
    "ReleaseIoBinding": CFUNCTYPE(None, c_void_p),
    "BindInput": CFUNCTYPE(_STATUS, c_void_p, c_char_p, c_void_p),
    "BindOutput": CFUNCTYPE(_STATUS, c_void_p, c_char_p, c_void_p),
}
_ELEMENT = {np.dtype(np.float32): 1, np.dtype(np.uint8): 2, np.dtype(np.int32): 6}  # ONNXTensorElementDataType
_LOG_ERROR = 3
_DISABLE_ALL = 0  # the decode graphs come optimized from the graph cache
_DEVICE_ALLOCATOR, _MEM_DEFAULT = 0, 0


class OrtError(RuntimeError):
    """A C API call failed; the message is ONNX Runtime's."""


class OrtC:
    """The C API of the wheel's ONNX Runtime library, one per process (`OrtC.get()`)."""

    def __init__(self, path: str, expect_version: str | None = None):
        """expect_version: the Python module's ONNX Runtime version, which the library must report (the slots
        above are checked against this release's header; another build's table may differ)."""
        lib = ctypes.CDLL(path)
        base = CFUNCTYPE(c_void_p)(("OrtGetApiBase", lib))()
        get_api = CFUNCTYPE(c_void_p, c_uint32).from_address(base)  # OrtApiBase.GetApi
        version = CFUNCTYPE(c_char_p).from_address(base + ctypes.sizeof(c_void_p))().decode()  # GetVersionString
        if expect_version is not None and version != expect_version:
            raise BackendUnavailable(f"ONNX Runtime's C library {path} is version {version}, the Python module "
                                     f"{expect_version}")
        self.version = version
        api = get_api(_API_VERSION)
        if not api:
            raise BackendUnavailable(f"ONNX Runtime's C library {path} does not serve API version {_API_VERSION}")
        table = (c_void_p * (max(_SLOTS.values()) + 1)).from_address(api)
        self._lib = lib
        self.fn = {name: _PROTOS[name](table[slot]) for name, slot in _SLOTS.items()}
        self.run_fn = int(table[_SLOTS["RunWithBinding"]])  # for compiled callers (`native.call3`)
        env, mem = c_void_p(), c_void_p()
        self.check(self.fn["CreateEnv"](_LOG_ERROR, b"hetero-decode", byref(env)))
        self.check(self.fn["CreateCpuMemoryInfo"](_DEVICE_ALLOCATOR, _MEM_DEFAULT, byref(mem)))
        self.env, self.mem = env, mem

    @staticmethod
    @functools.cache
    def get() -> "OrtC":
        """The process's instance; BackendUnavailable when the wheel's C library cannot be loaded."""
        import onnxruntime

        found = sorted(glob.glob(os.path.join(os.path.dirname(onnxruntime.__file__), "capi", "libonnxruntime.so*")))
        if not found:
            raise BackendUnavailable("onnxruntime ships no C library (capi/libonnxruntime.so*) here")
        # the file named for the module's version, when several releases' libraries lie there (onnxruntime-qnn
        # installs its own copy beside onnxruntime's)
        path = next((f for f in found if f.endswith(f".so.{onnxruntime.__version__}")), found[-1])
        try:
            return OrtC(path, onnxruntime.__version__)
        except OSError as e:
            raise BackendUnavailable(f"cannot load ONNX Runtime's C library {path}: {e}") from e

    def check(self, status: int | None) -> None:
        """Raise OrtError with the message of a non-NULL OrtStatus* (and release it)."""
        if status:
            msg = self.fn["GetErrorMessage"](status).decode(errors="replace")
            self.fn["ReleaseStatus"](status)
            raise OrtError(msg)

    def session(self, model: "onnx.ModelProto | bytes") -> "Session":
        """A session of `model` (or its serialization) on one thread: no spinning, no arena, no further graph
        optimization."""
        f = self.fn
        so = c_void_p()
        self.check(f["CreateSessionOptions"](byref(so)))
        try:
            self.check(f["SetIntraOpNumThreads"](so, 1))
            self.check(f["SetInterOpNumThreads"](so, 1))
            self.check(f["SetSessionGraphOptimizationLevel"](so, _DISABLE_ALL))
            self.check(f["DisableCpuMemArena"](so))
            self.check(f["AddSessionConfigEntry"](so, b"session.intra_op.allow_spinning", b"0"))
            data = model if isinstance(model, bytes) else model.SerializeToString()
            sess = c_void_p()
            self.check(f["CreateSessionFromArray"](self.env, data, len(data), so, byref(sess)))
        finally:
            f["ReleaseSessionOptions"](so)
        return Session(self, sess.value)


@functools.cache
def run_fn() -> int:
    """RunWithBinding's address for compiled callers (`native.call3`), 0 when the C library is unavailable."""
    try:
        return OrtC.get().run_fn
    except BackendUnavailable as e:
        log.warning("%s: decode steps run their graphs whole, on one thread (the attention helper stays)", e)
        return 0


class Session:
    """An OrtSession* (released with this object)."""

    def __init__(self, ortc: OrtC, ptr: int):
        self.ortc, self.ptr = ortc, ptr
        weakref.finalize(self, ortc.fn["ReleaseSession"], ptr)

    def bind(self, inputs: dict[str, tuple], outputs: dict[str, tuple]) -> "Binding":
        """An IOBinding of the named inputs and outputs to buffers the caller keeps alive: (address, shape) of
        float32, or (address, shape, numpy dtype) of uint8 / int32."""
        return Binding(self, inputs, outputs)


class Binding:
    """An OrtIoBinding* over fixed buffers, with its OrtValues (released with this object)."""

    def __init__(self, session: Session, inputs: dict[str, tuple], outputs: dict[str, tuple]):
        ortc, f = session.ortc, session.ortc.fn
        b = c_void_p()
        ortc.check(f["CreateIoBinding"](session.ptr, byref(b)))
        self.session, self.ptr, self._values = session, b.value, []
        weakref.finalize(self, _release_binding, f, self.ptr, self._values)
        for names, bind in ((inputs, f["BindInput"]), (outputs, f["BindOutput"])):
            for name, (addr, shape, *dtype) in names.items():
                dt = np.dtype(dtype[0] if dtype else np.float32)
                dims = (c_int64 * len(shape))(*shape)
                value = c_void_p()
                ortc.check(f["CreateTensorWithDataAsOrtValue"](ortc.mem, addr, dt.itemsize * int(np.prod(shape)),
                                                               dims, len(shape), _ELEMENT[dt], byref(value)))
                self._values.append(value.value)
                ortc.check(bind(self.ptr, name.encode(), value))


def _release_binding(f: dict, ptr: int, values: list[int]) -> None:
    f["ReleaseIoBinding"](ptr)
    for v in values:
        f["ReleaseValue"](v)
