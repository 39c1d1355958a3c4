"""Providers: the ONNX Runtime execution providers a static graph runs on (CPU EP, or QNN EP with HTP).

ExecuTorch's split: *export* (`export.build_segment`, pure), *compile* (a provider turns the ONNX graph
into a cached artifact: the ORT-optimized model or a QNN context binary), *session* (`Graph`: load once,
bind buffers, run many); `prepare_graph` ties them together. `Graph.run` binds numpy inputs by address and has
ORT write outputs into preallocated arrays (IOBinding): the caller's buffers, or the graph's own.
"""

from __future__ import annotations

import abc
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from hetero import buffers
from hetero.buffers import f32_address
from hetero.errors import BackendUnavailable, ConfigError, GraphCacheError
from hetero.npu import isa, segments
from hetero.npu.cache import FORMAT, CacheEntry, entry_key, library_versions
from hetero.npu.stdio import stdout_to_stderr
from hetero.paths import atomic_path, cache_unwritable, warn_once
from hetero.sessions import cpu_session, ep_session, session_options

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)

_QNN_REGISTERED = False


@dataclass(slots=True)
class Graph:
    """A loaded session of one segment with its IOBinding and its own output buffers."""

    session: ort.InferenceSession
    spec: segments.SegmentSpec
    inputs: dict[str, int]  # name → width ([C, width] float32)
    outputs: dict[str, int]
    device: str  # "cpu" | "npu": the hardware its provider runs on
    path: Path | None = None  # the compiled model in the graph cache (None: built without the cache)
    buffers: dict[str, np.ndarray] = field(init=False)  # outputs not given by the caller, made once
    _local: threading.local = field(init=False)

    def __post_init__(self) -> None:
        self.buffers = {}
        self._local = threading.local()

    @property
    def binding(self) -> ort.IOBinding:
        """This thread's IOBinding of the session, for a caller that binds it itself (`run` then binds anew): two
        lanes may run one graph at once (a layer's o→FFN graph for two chunks, `npu.nodes.HALF_PLACEMENT`), and a
        binding holds the buffers of one run."""
        self._local.key = None
        return self._thread_binding()

    def _thread_binding(self) -> ort.IOBinding:
        b = getattr(self._local, "binding", None)
        if b is None:
            b = self._local.binding = self.session.io_binding()
        return b

    def _what(self, name: str) -> str:
        return f"graph {self.spec.kind} of layer {self.spec.layer}: buffer {name}"

    def run(self, inputs: dict[str, np.ndarray], out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Run on float32 [rows, width] numpy arrays (an input that is not C-contiguous float32 is copied into one);
        returns the outputs. Threads may run one graph at once when each gives every output in `out`.

        rows = C for a fixed-shape graph, the inputs' row count for one with dynamic rows. ORT writes each
        output into `out[name]` (C-contiguous float32) when given, else into this graph's own buffer (grown to the
        most rows seen), which the next run of this graph overwrites: callers keep only what they passed in `out`.
        A run on the same buffers and rows as this thread's last run of the graph skips binding them (a lane runs
        one chunk of a short prompt: binding anew cost ~23 µs a graph run, 2.5% of a 64-token prefill; docs/journal.md,
        "Issue 24 (session 16)").
        """
        c = self.spec.chunk
        key: list[int] = []
        for name, width in self.inputs.items():
            t = inputs[name]
            if t.dtype != np.float32 or not t.flags.c_contiguous:
                t = inputs[name] = np.ascontiguousarray(t, dtype=np.float32)  # keeps it alive until run returns
            if t.shape[0] != (c or t.shape[0]) or t.shape[1:] != (width,):
                raise ConfigError(f"graph {self.spec.kind} of layer {self.spec.layer} takes [{c or 'rows'}, {width}] "
                                  f"for {name}, got {list(t.shape)}")
            c = c or t.shape[0]
            key.append(t.ctypes.data)
        res = {}
        for name, width in self.outputs.items():
            o = out.get(name) if out else None
            if o is None:
                o = self.buffers.get(name)
                if o is None or o.shape[0] < c:
                    o = self.buffers[name] = buffers.empty((c, width))
                o = o[:c]
            elif o.shape[0] < c or o.shape[1:] != (width,):
                raise ConfigError(f"{self._what(name)} must be [{c} or more, {width}], got {list(o.shape)}")
            key.append(f32_address(o, self._what(name)))
            res[name] = o
        self.run_at(c, tuple(key))
        return res

    def run_at(self, rows: int, addresses: tuple[int, ...]) -> None:
        """`run` on the addresses of C-contiguous float32 [rows, width] buffers, the inputs' then the outputs' in
        `inputs` / `outputs` order, unchecked (a prefill's runtime-owned buffers, checked once per prompt)."""
        self.session.run_with_iobinding(self._bound((*addresses, rows)))

    def _bound(self, key: tuple[int, ...]) -> ort.IOBinding:
        """This thread's binding (`binding`), bound to the inputs' and outputs' addresses and the row count in `key`
        (`run`'s order) unless its last run's were the same. One binding a thread, not one per buffer set: a binding
        that has run keeps that run's intermediate buffers (~5 MB at 256 rows for an o→FFN graph), so one per chunk
        added 220 MB to a 2048-token prefill's process."""
        b = self._thread_binding()
        if getattr(self._local, "key", None) != key:
            c, addresses = key[-1], iter(key)
            for name, width in self.inputs.items():
                b.bind_input(name, "cpu", 0, np.float32, (c, width), next(addresses))
            for name, width in self.outputs.items():
                b.bind_output(name, "cpu", 0, np.float32, (c, width), next(addresses))
            self._local.key = key
        return b

    def bind(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> ort.IOBinding:
        """A binding of its own to fixed C-contiguous float32 [rows, width] numpy buffers, made once: each
        `session.run_with_iobinding(binding)` then reads and writes them in place (the decode step's
        graphs, `hetero.decode.bound_step`). The caller keeps the buffers alive while it uses the binding."""
        b = self.session.io_binding()
        for names, bind in ((inputs, b.bind_input), (outputs, b.bind_output)):
            for name, t in names.items():
                bind(name, "cpu", 0, np.float32, tuple(t.shape), f32_address(t, self._what(name)))
        return b


class Provider(abc.ABC):
    """An ONNX Runtime execution provider that runs static graphs: how to compile one into a cacheable
    artifact and load it. `device` is the hardware it runs on (the CPU EP stands in for an NPU)."""

    name = "provider"
    flavor = "cpu"
    device = "cpu"

    @abc.abstractmethod
    def options_key(self) -> dict: ...

    @abc.abstractmethod
    def compile(self, model_path: Path, out_path: Path, ops: bool = False) -> ort.InferenceSession:
        """ops: the graph holds hetero's own ops (`native.ort_ops`), which the session must register."""

    @abc.abstractmethod
    def load(self, path: Path, ops: bool = False) -> ort.InferenceSession: ...


class OrtCpuProvider(Provider):
    """ONNX Runtime CPU EP; compiled artifact = the ORT-optimized model (level ALL, this machine)."""

    name, flavor, device = "ort-cpu", "cpu", "cpu"

    def __init__(self, intra_op_threads: int = 2, inter_op_threads: int = 1, pool: str | None = None):
        """pool: the runtime's ONNX Runtime pool mode (`threads.ExecutionPlan.ort_pool`); None: the environment's."""
        self.intra_op_threads, self.inter_op_threads, self.pool = intra_op_threads, inter_op_threads, pool

    def options_key(self) -> dict:
        # the level-ALL optimized model may hold CPU-specific kernels: key it to the machine
        return {"lane": self.name, "opt": "all", **isa.machine()}  # "lane": kept, it is in every cache key

    def _session(self, model: Path, ops: bool, **kw) -> ort.InferenceSession:
        # no per-session arena: one per graph (a model has ~100) would each keep its high-water mark of
        # activations; plain allocations return it (peak RSS: bench/results/prefill.json). ops: the graph holds
        # hetero's own ops, whose library the session registers (a ConfigError where it cannot run here)
        from hetero.native import ort_ops  # (only its small module: a graph without the ops never builds it)

        return cpu_session(model, self.intra_op_threads, self.pool, arena=False, inter_op_threads=self.inter_op_threads,
                           custom_ops=ort_ops.library_path() if ops else None, **kw)

    def compile(self, model_path: Path, out_path: Path, ops: bool = False) -> ort.InferenceSession:
        return self._session(model_path, ops, optimize="all", save_optimized=out_path)

    def load(self, path: Path, ops: bool = False) -> ort.InferenceSession:
        return self._session(path, ops, optimize="none")  # already optimized



def qnn_devices() -> list:
    """The QNN EP's devices after registering the plugin library; BackendUnavailable if it is absent."""
    global _QNN_REGISTERED
    try:
        import onnxruntime_qnn
    except ImportError as e:
        raise BackendUnavailable("QNN EP unavailable: onnxruntime-qnn is not installed (pip install 'hetero[qnn]')") from e
    if not _QNN_REGISTERED:
        try:
            ort.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())
        except Exception as e:
            if "already" not in str(e).lower():
                raise BackendUnavailable(f"QNN EP unavailable: cannot register its library: {e}") from e
        _QNN_REGISTERED = True
    devs = [d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider"]
    if not devs:
        raise BackendUnavailable("QNN EP unavailable: registered, but it reports no device")
    return devs


QNN_CONTEXT_STEM = "qnn_ctx"
QNN_CONTEXT_BIN = QNN_CONTEXT_STEM + "_qnn.bin"  # the name the QNN EP gives the binary of `<stem>.onnx`


# No soc_model: the simulator then models a generic HTP whose float ops (RMSNorm, SiLU, residual adds) run
# in fp32, and a 30-layer prefill answers like the CPU path. With soc_model 60 (Snapdragon 8 Gen 3, the
# paper's Xiaomi 14) more graphs build (C=32 and C=256, which fail here with QNN_COMMON_ERROR_MEM_ALLOC) but
# float ops run in fp16, as on a device, where the fp16-safe RMSNorm still fails on some rows
# (`constraints.QNN_CONSTRAINTS["soc_model_fp16"]`).
# Opt in with provider_options={"soc_model": "60"} or HETERO_QNN_OPTIONS=soc_model=60.
QNN_DEFAULT_OPTIONS = {"backend_type": "htp"}


def env_qnn_options() -> dict[str, str]:
    """QNN EP provider options from $HETERO_QNN_OPTIONS, "key=value,key=value" (e.g. "soc_model=60"): how a
    CLI run (`hetero run --method hetero-qnn`, `hetero bench`) reaches the provider without new flags."""
    text = os.environ.get("HETERO_QNN_OPTIONS", "").strip()
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"HETERO_QNN_OPTIONS must be 'key=value,key=value' (e.g. 'soc_model=60'), got {text!r}")
        out[key.strip()] = value.strip()
    return out


class QnnHtpProvider(Provider):
    """QNN EP with the HTP backend (on x86 Linux: the simulator); artifact = an EP context model and its
    QNN context binary. CPU fallback is disabled: a graph HTP cannot take fails loudly."""

    name, flavor, device = "qnn-htp", "qnn", "npu"

    def __init__(self, provider_options: dict[str, str] | None = None):
        self.devices = qnn_devices()
        self.provider_options = {**QNN_DEFAULT_OPTIONS, **env_qnn_options(), **(provider_options or {})}
        soc = self.provider_options.get("soc_model")
        # a SoC model is another HTP (its graph cache, its recorded equivalent shapes) whose float ops run in
        # fp16, as on the device: graphs of the fp16-safe flavour (`export.rms_norm`)
        self.name = f"qnn-htp-soc{soc}" if soc else "qnn-htp"
        self.flavor = "qnn-fp16" if soc else "qnn"

    def options_key(self) -> dict:
        return {"lane": self.name, "context_embed_mode": 0, **self.provider_options}

    def _options(self) -> ort.SessionOptions:
        so = session_options()
        so.add_provider_for_devices(self.devices, self.provider_options)
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        return so

    def compile(self, model_path: Path, out_path: Path, ops: bool = False) -> ort.InferenceSession:
        _no_ops(ops)
        # The context binary goes in its own file (embed mode 0, `QNN_CONTEXT_BIN` beside the model), not
        # into the ONNX protobuf: loading then skips parsing ~7 MB of protobuf per graph (2.1x faster
        # loads on the simulator, 24 graphs at C=128). The EP names the binary after the context model,
        # so it is written under a fixed stem and moved to `out_path` (the caller's atomic temp file).
        ctx = out_path.parent / (QNN_CONTEXT_STEM + ".onnx")
        ctx.unlink(missing_ok=True)  # the EP refuses to overwrite an existing context model
        so = self._options()
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_embed_mode", "0")
        so.add_session_config_entry("ep.context_file_path", str(ctx))
        with stdout_to_stderr():  # the simulator's banner on its first session (`npu.stdio`)
            sess = ep_session(model_path, so)
        if not (out_path.parent / QNN_CONTEXT_BIN).exists():
            raise GraphCacheError(f"QNN EP wrote no context binary {QNN_CONTEXT_BIN} beside {ctx}")
        ctx.replace(out_path)
        return sess

    def load(self, path: Path, ops: bool = False) -> ort.InferenceSession:
        _no_ops(ops)
        with stdout_to_stderr():
            return ep_session(path, self._options())


def _no_ops(ops: bool) -> None:
    if ops:
        raise ConfigError("hetero's own ONNX Runtime ops (`native.ort_ops`) run on the CPU EP only, not on QNN HTP")


def make_provider(kind: str = "cpu", intra_op_threads: int = 2, pool: str | None = None, **options) -> Provider:
    """"cpu" → OrtCpuProvider; "qnn" → QnnHtpProvider, or (warning once) OrtCpuProvider when QNN is absent."""
    if kind in ("cpu", "ort-cpu"):
        return OrtCpuProvider(intra_op_threads, pool=pool, **options)
    if kind in ("qnn", "qnn-htp", "npu"):
        try:
            return QnnHtpProvider(options.get("provider_options"))
        except BackendUnavailable as e:
            warn_once("qnn", "%s; falling back to the ONNX Runtime CPU EP", e)
            return OrtCpuProvider(intra_op_threads, pool=pool)
    raise ConfigError(f"provider kind must be 'cpu' or 'qnn', got {kind!r}")


@dataclass(frozen=True, slots=True)
class PrepareInfo:
    """How one graph was obtained."""

    key: str
    cached: bool  # loaded from the cache (True) or exported + compiled now (False)
    seconds: float
    size_bytes: int  # compiled artifact on disk


def graph_key(spec: segments.SegmentSpec, layer_digest: str, model_fp: str, provider: Provider) -> str:
    layer = (segments.LAYER_VERSION, spec.attn, spec.shadows, spec.a_rotated) if spec.in_graph else ()  # (segments: as before)
    if spec.native_ops:  # what hetero's ops compute (their source) is part of the graph
        from hetero.native import ort_ops

        layer = (*layer, "ort-ops", ort_ops.key())
    return entry_key("hetero-graph", FORMAT, segments.EXPORT_VERSION, spec.kind, spec.pieces, spec.chunk, spec.flavor,
                     spec.shape, spec.emit_x, spec.layer, layer_digest, model_fp, provider.options_key(),
                     library_versions(), *layer)


def prepare_graph(spec: segments.SegmentSpec, lq: segments.LayerQ, model_fp: str, provider: Provider,
                  use_cache: bool = True, layer_digest: str | None = None,
                  graphs_root: Path | None = None) -> tuple[Graph, PrepareInfo]:
    """Load one segment's compiled graph from the cache, or export, compile and cache it (`compiled_entry`).

    layer_digest: `segments.layer_digest(lq)` when the caller already has it (one per layer, not per graph).
    graphs_root: the graph cache folder (default `cache.graphs_root()`).
    """
    t0 = time.perf_counter()
    ins, outs = segments.segment_io(spec, lq)
    key = graph_key(spec, layer_digest or segments.layer_digest(lq), model_fp, provider)
    what = f"layer {spec.layer} {spec.kind} (C={spec.chunk}, shape {spec.shape})"

    def build() -> "onnx.ModelProto":
        from hetero.npu import export  # onnx: only when a graph is built (a warm start loads them all)

        return export.build_segment(spec, lq)

    sess, cached, size, path = compiled_entry(key, spec, provider, build, what, use_cache, graphs_root)
    return (Graph(sess, spec, ins, outs, provider.device, path),
            PrepareInfo(key, cached, time.perf_counter() - t0, size))


def compiled_entry(key: str, spec: object, provider: Provider, build: "Callable[[], onnx.ModelProto]", what: str,
                   use_cache: bool = True, graphs_root: Path | None = None
                   ) -> tuple[ort.InferenceSession, bool, int, Path | None]:
    """(session, loaded from the cache, entry bytes, compiled path or None) of the graph `build()` exports under
    `key`: loaded from the cache, or built, compiled and cached. `spec` is recorded in the entry's meta.json;
    `what` names the graph in errors.

    Processes sharing the cache build an entry once: under the entry's lock, in a private folder renamed
    into place (`cache.CacheEntry.staging`); one that waited reuses the entry the other built. A cache
    that cannot be written gives a warning and an uncached build.
    """
    entry = CacheEntry.of(provider.name, key, graphs_root)
    ops = bool(getattr(spec, "native_ops", False))  # the graph holds hetero's own ops (`native.ort_ops`)
    if use_cache:
        found = _load_entry(entry, provider, ops, repair=False)  # the common case: no lock taken
        if found is not None:
            return (*found, entry.compiled_path)
        try:
            with entry.lock():
                found = _load_entry(entry, provider, ops, repair=True)  # another process may have built it meanwhile
                if found is not None:
                    return (*found, entry.compiled_path)
                with entry.staging() as stage:
                    sess = _compile(build, what, provider, stage, ops)
                    stage.commit(spec, {"lane": provider.options_key()})
                    size = stage.size_bytes()
            return sess, False, size, entry.compiled_path
        except OSError as e:  # read-only, full or foreign cache: build without it
            cache_unwritable(entry.root.parent, e)
        except GraphCacheError as e:  # a compiler that hit a full disk says so in its own words: try
            sess, size = _compile_uncached(build, what, provider, key, ops)  # outside the cache; raises if not that
            cache_unwritable(entry.root.parent, e)
            return sess, False, size, None
    sess, size = _compile_uncached(build, what, provider, key, ops)
    return sess, False, size, None


def _compile_uncached(build: "Callable[[], onnx.ModelProto]", what: str, provider: Provider,
                      key: str, ops: bool = False) -> tuple[ort.InferenceSession, int]:
    """(session, bytes) of a graph built in a temporary folder, outside the cache."""
    with tempfile.TemporaryDirectory(prefix="hetero-graph-") as d:
        stage = CacheEntry(Path(d), key)
        sess = _compile(build, what, provider, stage, ops)
        return sess, stage.size_bytes()


def _load_entry(entry: CacheEntry, provider: Provider, ops: bool, repair: bool) -> tuple[ort.InferenceSession, bool, int] | None:
    """(session, True, bytes) of a cached entry that verifies and loads; else None. repair (under the
    entry's lock only): warn about a damaged entry and delete it."""
    try:
        found = entry.read_compiled()
    except GraphCacheError as e:
        if repair:  # one warning per cache (a restored or rotted cache may have every entry damaged)
            warn_once(f"damaged:{entry.root.parent}", "%s; rebuilding it", e)
            entry.discard()
        return None
    if found is None:
        return None
    try:
        return provider.load(found[0], ops), True, found[1]
    except Exception as e:  # a library that changed underneath, or damage the stat stamp hid
        if repair:
            warn_once(f"damaged:{entry.root.parent}", "graph cache entry %s fails to load (%s); rebuilding it",
                      entry.root, e)
            entry.discard()
        return None


def _compile(build: "Callable[[], onnx.ModelProto]", what: str, provider: Provider,
             stage: CacheEntry, ops: bool = False) -> ort.InferenceSession:
    """Export the graph `build()` makes into `stage` and compile it there; GraphCacheError names what failed."""
    from hetero.npu import export  # onnx: only when a graph is built (a warm start loads them all)

    export.save_onnx(build(), stage.model_path)
    try:
        with atomic_path(stage.compiled_path) as tmp:
            sess = provider.compile(stage.model_path, tmp, ops)
            if not tmp.exists() or tmp.stat().st_size == 0:
                raise GraphCacheError(f"{provider.name} wrote no compiled graph for {what}")
    except GraphCacheError:
        raise
    except Exception as e:
        raise GraphCacheError(f"{provider.name} failed to compile {what}: {e}") from e
    return sess
