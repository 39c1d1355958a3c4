"""`NpuBackend`: the static subgraphs of every layer as prebuilt INT8 graphs on a provider (mllm-NPU §3.2).

Each layer's segments (`segments.layer_segments`) are fixed-shape graphs of chunk length C, built once or
loaded from the graph cache and shared by every chunk; where the plan keeps a shadow (Eq. 1) the graph is
cut after that linear and `QuantizedBackend.shadow_delta` is added in place on the CPU. Which device runs
which graph comes from a `Placement` (NPU memory budget, §4); by default the given provider runs all.

Its buffers are float32 numpy arrays (`tensors = "numpy"`): a warm start reads the model's norms and biases from
`Model.arrays()` and never imports torch; the shadow corrections' float math is torch's, imported when a
segmented backend first computes one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from hetero import buffers, layerspec, progress
from hetero.attention import row_twice
from hetero.chunking import check_chunk
from hetero.errors import ConfigError
from hetero.loader import Model
from hetero.nodes import DEFAULT_PLACEMENT, Job
from hetero.weights import SITES
from hetero.npu import nodes, segments
from hetero.npu.program import GraphRun, LayerProgram, layer_program
from hetero.buffers import f32_address
from hetero.npu.providers import OrtCpuProvider, Provider, make_provider, prepare_graph
from hetero.npu.segments import Buffer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PrepareReport:
    """How the graph set was obtained: per graph (layer, kind, provider, cached, seconds, bytes)."""

    rows: list[tuple[int, str, str, bool, float, int]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(r[4] for r in self.rows)

    @property
    def size_bytes(self) -> int:
        return sum(r[5] for r in self.rows)

    @property
    def all_cached(self) -> bool:
        return all(r[3] for r in self.rows)


def _shadow_only(plan):
    """`plan` with the INT8 weights of shadowed sites only (what the CPU dequantizes for outliers)."""
    from hetero.weights import SITE_LINEARS

    keep = {(layer, n) for (layer, site), sq in plan.sites.items() if sq.shadow for n in SITE_LINEARS[site]}
    # copies, not views: a view of the cached weights file keeps its mapping, and every page the graphs' build read,
    # resident (~100 MB on the default model) beside ONNX Runtime's own copy
    def copied(w):
        return dataclasses.replace(w, **{f.name: np.array(getattr(w, f.name)) for f in dataclasses.fields(w)
                                         if isinstance(getattr(w, f.name), np.ndarray)})

    return dataclasses.replace(plan, weights={k: copied(w) for k, w in plan.weights.items() if k in keep})


def attention_kernel(cfg, mode: str):
    """(a fused backend's attention kernel or None, why): `GraphOptions.attention` resolved on this host."""
    if mode not in ("auto", "bf16", "gqa"):
        raise ConfigError(f"attention must be 'auto', 'bf16' or 'gqa', got {mode!r}")
    if mode == "gqa":
        return None, "ONNX Runtime's GroupQueryAttention (fp32) inside each layer graph, as asked"
    from hetero.native.attention import Bf16Attention, unavailable

    why = unavailable(cfg)
    if why is None:
        return Bf16Attention(cfg), ("hetero's BF16 attention kernel (AVX-512 BF16) between each layer's two graphs "
                                    "(`native.attention`)")
    if mode == "bf16":
        raise ConfigError(f"the BF16 attention kernel cannot run here: {why}")
    return None, f"ONNX Runtime's GroupQueryAttention (fp32) inside each layer graph: the BF16 kernel cannot run ({why})"


def graph_memory_bytes(cfg, chunk: int, n_layers: int) -> int:
    """An estimate of what the prepared graphs of `n_layers` layers hold at chunk length C: each ONNX
    Runtime session keeps its own arena, sized by its largest activations ([C, ffn] gate/up/act and
    their INT8 copies, [C, hidden] residuals), so the total grows with C times the graph count."""
    per_row = 4 * (3 * cfg.ffn + 4 * cfg.hidden + cfg.q_dim + 2 * cfg.kv_dim)
    return 2 * n_layers * chunk * per_row  # two graphs (qkv, o_ffn) per layer


def check_graph_memory(cfg, chunk: int, n_layers: int) -> None:
    """ConfigError when the graphs of chunk length C would not fit in the memory available now."""
    import psutil

    need, free = graph_memory_bytes(cfg, chunk, n_layers), psutil.virtual_memory().available
    if need > free // 2:  # leave half for the weights, the KV cache and everything else
        raise ConfigError(f"chunk {chunk} needs about {need / 2**30:.1f} GiB of graph buffers ({2 * n_layers} "
                          f"graphs), more than half of the {free / 2**30:.1f} GiB available: use a smaller chunk")


@dataclass(frozen=True, slots=True)
class GraphOptions:
    """How an `NpuBackend` prepares and runs its graphs (everything but what they compute).

    intra_op_threads / ort_pool: the CPU EP sessions' threads and pool mode (the runtime's `threads.ExecutionPlan`;
    ort_pool None: the environment's). placement: optional `placement.Placement`; its "cpu" decisions run on the
    CPU EP. shape: "auto" (the winner `hetero npu shapes` recorded for this host, provider, kind and C; "2d" when
    none is recorded), or "2d", "3d:a", "conv:a" for every graph (§4, optimisation 1). dynamic_rows: one graph set
    for every chunk length (rows symbolic) where the provider allows it (the CPU EP); None: when every graph runs on
    the CPU EP with shape "auto" or "2d". use_cache / graphs_root: the graph cache and its folder (default: under
    the user cache). fused: each layer one graph (qkv → attention over the KV cache → o → FFN, shadow corrections
inside), run by `NpuBackend.layer` on the sessions' threads: where the NPU lane is the CPU (`placement.prefill_layout`)."""

    intra_op_threads: int = 2
    ort_pool: str | None = None
    placement: object = None
    shape: str = "auto"
    dynamic_rows: bool | None = None
    use_cache: bool = True
    graphs_root: object = None
    fused: bool = False  # one graph per layer, attention and shadows inside (`segments.layer_graph`; CPU EP only)
    # a fused backend's attention: "auto" (the BF16 kernel where this host and model allow it, `native.attention`,
    # else the graph's GroupQueryAttention node), "bf16" (the kernel or a ConfigError) or "gqa" (the node)
    attention: str = "auto"
    # a fused backend with the BF16 attention: its halves' float glue (RMSNorm and quantization, SiLU·up, down_in's
    # online Hadamard, the residual adds) as hetero's own ops (`native.ort_ops`) where they run on this host and the
    # plan allows them (None), never (False), or a ConfigError where they cannot (True)
    native_ops: bool | None = None


def native_ops_why(cfg, online: dict[str, int], attention, mode: bool | None) -> tuple[bool, str]:
    """(whether a fused backend's halves compute their float glue with hetero's ops, why): `GraphOptions.native_ops`
    resolved on this host and a plan with these online transforms (a site with a shadow, 16 bits or an online transform
    of its own keeps the nodes: `export`)."""
    if mode is False:
        return False, "ONNX Runtime nodes, as asked"
    from hetero.native import ort_ops

    lacks = layerspec.lacks(layerspec.LayerSpec.of(cfg), "native glue ops")
    needs = ("the halves around the BF16 attention kernel" if attention is None else
             f"a layer without {lacks}" if lacks else
             f"a rotated plan's {ort_ops.BLOCK}-block online Hadamard at down_in"
             if online.get("down_in") != ort_ops.BLOCK else None)
    why = f"it needs {needs}" if needs else ort_ops.unavailable()
    if why is None:
        return True, (f"hetero's own ONNX Runtime ops in the layer graphs ({ort_ops.SILU_HADAMARD_QUANT}, "
                      f"{ort_ops.ADD_RMS_NORM_QUANT}, {ort_ops.SCALE_ADD}, {ort_ops.RMS_NORM_QUANT}, "
                      f"{ort_ops.HADAMARD_QUANT}, {ort_ops.HADAMARD_QUANT16}, {ort_ops.HADAMARD_ROW_QUANT}: "
                      f"`native.ort_ops`)")
    if mode:
        raise ConfigError(f"hetero's own ONNX Runtime op cannot compute this backend's graphs: {why}")
    return False, f"ONNX Runtime nodes ({why})"


PREPARE_THREADS = 4  # at most this many threads load a backend's graphs (`NpuBackend._prepare_layers`)


class NpuBackend:
    """A `LayerBackend` running prebuilt chunk-sharing INT8 graphs (`Runtime(model, chunk=C, backend=...)`).

    plan: a `hetero.outliers.plan.QuantPlan`. provider: "cpu", "qnn" (falls back to CPU with a warning) or a
    `providers.Provider`. options: `GraphOptions`. layers: prepare only these layers (e.g. range(2) for a quick
    test); the others raise on use. When the graphs take any row count (`GraphOptions.dynamic_rows`), `any_rows`
    is True and a runtime may run chunks of any length up to C without padding.
    """

    name = "npu"
    tensors = "numpy"  # qkv / o_ffn / layer take and return float32 numpy arrays
    node_kinds = nodes.KINDS  # the generic layer's three, and a whole layer as one node or two halves (`npu.nodes`)
    default_placement = DEFAULT_PLACEMENT  # the generic layer's (a fused backend's qkv / o_ffn: its plan's segments)

    def __init__(self, model: Model, plan, chunk: int, provider: "str | Provider" = "cpu", *, layers=None, rows=None,
                 options: GraphOptions = GraphOptions()):
        model.config.check_quantizable("the NPU backend")
        check_chunk(chunk, model.config.context_length)
        check_graph_memory(model.config, chunk, model.config.n_layers if layers is None else len(layers))
        self.model, self.cfg, self.plan, self.chunk, self.options = model, model.config, plan, chunk, options
        o = options
        self.provider = make_provider(provider, o.intra_op_threads, o.ort_pool) if isinstance(provider, str) else provider
        self.name = f"npu[{self.provider.name}]"
        # the shadows' float reference (`QuantizedBackend`: its shadow_delta(_rows), torch): `_shadow_reference`
        self._reference, self._rows, self._reference_lock = None, rows, threading.Lock()
        self.placement, self.shape = o.placement, o.shape
        self._cpu_provider = self.provider if isinstance(self.provider, OrtCpuProvider) else None
        # On the CPU EP a recorded 3-D winner is a few percent; padding a short prompt to C costs up to C/rows.
        can = isinstance(self.provider, OrtCpuProvider) and o.placement is None and o.shape in ("auto", "2d")
        if o.dynamic_rows and not can:
            raise ConfigError("dynamic_rows needs the CPU EP provider, no placement and shape 'auto' or '2d'")
        self.any_rows = can if o.dynamic_rows is None else o.dynamic_rows
        # a prompt's K/V and logits do not depend on where it was cut (`serve.store.cut_invariant`): measured on the
        # CPU EP for every method (tests/test_cut_invariance.py, bench/results/determinism.md); an NPU's kernels unknown
        self.cut_invariant = isinstance(self.provider, OrtCpuProvider)
        self.fused = o.fused
        # a fused backend's attention kernel outside ONNX Runtime (`native.attention`), between each layer's two
        # graphs (`segments.layer_halves`); None: the GroupQueryAttention node inside one graph per layer
        self.attention, self.attention_why = None, "segments: attention runs on the CPU lane"
        if o.fused:
            self.attention, self.attention_why = attention_kernel(self.cfg, o.attention)
            from hetero.attention import gqa_supported

            lacks = None if self.attention is not None else gqa_supported(self.cfg)
            if not (can and self.any_rows) or lacks:
                raise ConfigError("whole-layer graphs need the CPU EP provider with dynamic rows, no placement and "
                                  "shape 'auto' or '2d', and attention one GroupQueryAttention node computes"
                                  + (f" (this model has {lacks})" if lacks else ""))
            self._scratch = threading.local()  # per lane thread: the q|k|v and attention rows between the halves
        # a rotated model's o_in Hadamard of one head's size or blocks of it: the attention kernel applies it (on V's
        # rows) and the o → FFN graph takes its input rotated (3–4% of a layer's time at 256 rows on the default model
        # and on Gemma 3 270M: a [T·q_dim/64, 64] matmul)
        self._rotate_a = 0  # the block the kernel applies (0: none)
        if self.attention is not None:
            from hetero.native.attention import rotate_block_ok

            block = dict(plan.online).get("o_in", 0)
            self._rotate_a = block if rotate_block_ok(block, self.cfg.head_dim) else 0
        self.native_ops, self.native_ops_why = (native_ops_why(self.cfg, dict(plan.online), self.attention, o.native_ops)
                                                if o.fused else (False, "segments"))
        self._segmented: dict[int, NpuBackend] = {}  # a fused backend's decode graphs, per thread count
        self._programs: dict[int, LayerProgram] = {}
        self.report = PrepareReport()
        t0 = time.perf_counter()
        self._prepare_layers(list(range(self.cfg.n_layers) if layers is None else layers), o.use_cache)
        self._share_buffers()
        self._weights_dropped = layers is None and rows is None
        if self._weights_dropped:  # the graphs hold the INT8 weights now: keep only the shadows' (§3.3)
            self.plan, self._rows = _shadow_only(plan), None
        if any(p.shadowed for p in self._programs.values()):  # the CPU corrects these graphs' outputs: the
            self._shadow_reference()  # reference (and torch) now, not inside the first prefill's time
        self.prepare_s = time.perf_counter() - t0

    def at_chunk(self, chunk: int, intra_op_threads: int | None = None, provider: str | None = None) -> "NpuBackend":
        """The same plan's graphs at another chunk length (decode steps: C = 1 and the tree sizes): this backend
        itself when its graphs take any row count on the same provider and thread count (no new session), else
        a new backend over the same cached INT8 weights (`QuantPlan.from_dict`, `outliers.weightcache`).
        intra_op_threads: the new sessions' thread count when it differs from this backend's (CPU EP only:
        another provider keeps its own; the graph cache does not depend on it).
        provider: None (this backend's), or a provider name: "ort-cpu" runs them on the CPU EP (the decode
        steps of a prefill on an NPU, `placement.decode_placement`), with the plan's weights in the form the
        CPU EP runs exactly here (`isa.cpu_form_for`: the same integer weights)."""
        from hetero.outliers.plan import QuantPlan

        o, cpu = self.options, isinstance(self.provider, OrtCpuProvider)
        threads = intra_op_threads or o.intra_op_threads
        same_provider = provider is None or provider == self.provider.name
        if self.fused:  # the decode steps run the segments (`decode.bound_step`): the same plan's, made once
            seg = self._segmented.get(threads)
            if seg is None:
                plan = QuantPlan.from_dict(self.plan.to_dict(), self.model) if self._weights_dropped else self.plan
                seg = self._segmented[threads] = NpuBackend(
                    self.model, plan, self.chunk, OrtCpuProvider(threads, pool=o.ort_pool),
                    options=dataclasses.replace(o, intra_op_threads=threads, fused=False))
            return seg.at_chunk(chunk, threads, provider)
        if self.any_rows and chunk <= self.chunk and same_provider and (threads == o.intra_op_threads or not cpu):
            return self  # one graph set serves every row count: the decode sizes share these sessions
        plan = QuantPlan.from_dict(self.plan.to_dict(), self.model) if self._weights_dropped else self.plan
        if not same_provider:  # decode placement: the CPU EP's graphs of the same plan
            if provider != OrtCpuProvider.name:
                raise ConfigError(f"at_chunk: provider must be {self.provider.name!r} or {OrtCpuProvider.name!r}, "
                                  f"got {provider!r}")
            from hetero.npu.isa import cpu_form_for

            plan = dataclasses.replace(plan, weight_form=cpu_form_for(plan.weight_form))
            options = dataclasses.replace(o, intra_op_threads=threads, placement=None, shape="auto")
            return NpuBackend(self.model, plan, chunk, OrtCpuProvider(threads, pool=o.ort_pool), options=options)
        if cpu and threads != o.intra_op_threads:
            return NpuBackend(self.model, plan, chunk, OrtCpuProvider(threads, pool=o.ort_pool),
                              options=dataclasses.replace(o, intra_op_threads=threads))
        return NpuBackend(self.model, plan, chunk, self.provider, options=o)

    def _share_buffers(self) -> None:
        """The graphs at one position of every layer (qkv, then the o_ffn segments) share the buffers of the
        outputs a caller does not supply: a lane runs one subgraph at a time and every kind runs on one lane,
        so one layer's set serves them all (5.8 instead of 47 MB at C=256), and a layer's segments never alias."""
        shared: dict[int, dict[str, np.ndarray]] = {}
        for program in self._programs.values():
            for position, run in enumerate(program.runs):
                run.graph.buffers = shared.setdefault(position, {})

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers prepared (all of them unless `layers=` asked for some)."""
        return tuple(self._programs)

    @property
    def splittable(self) -> bool:
        """Whether its graphs are ONNX Runtime CPU EP graphs, which a one-row decode step may cut into column
        halves (`decode.twocore.halves`; not QNN context binaries)."""
        return isinstance(self.provider, OrtCpuProvider) and self.placement is None

    def program(self, layer: int) -> LayerProgram:
        """The layer's graphs in order and where shadow corrections follow them (`program`)."""
        program = self._programs.get(layer)
        if program is None:
            raise ConfigError(f"layer {layer} was not prepared (prepared: {sorted(self._programs)})")
        return program

    def shadow_delta(self, layer: int, site: str, x: np.ndarray, per_row: bool = False) -> np.ndarray | None:
        """The CPU side of Eq. 1 for a site's float input x [C, in] (None when no value lies beyond its scale).
        per_row: each row's alone (the rows of a decode token tree, `QuantizedBackend.shadow_delta_rows`).
        The float math is the reference's, in torch (imported here, at a shadowed site's first correction)."""
        import torch

        ref = self._shadow_reference()
        with torch.inference_mode():
            delta = (ref.shadow_delta_rows if per_row else ref.shadow_delta)(layer, site, torch.from_numpy(x))
        return None if delta is None else delta.numpy()

    def _shadow_reference(self):
        """The `QuantizedBackend` whose float math (torch, on `Model.weights`) computes the shadow corrections, made
        once: at set-up by a backend whose graphs leave corrections to the CPU (segments with shadow sites), never by
        one whose graphs hold them (whole-layer graphs, their decode graphs apart), so a warm default start imports
        no torch."""
        if self._reference is None:
            from hetero.outliers.shadow import QuantizedBackend

            with self._reference_lock:  # lane threads may ask at once: one reference
                if self._reference is None:
                    self._reference = QuantizedBackend(self.cfg, self.model.weights, self.plan, self._rows)
        return self._reference

    def _provider_for(self, layer: int, kind: str) -> Provider:
        if self.placement is None or self.placement.device_of(layer, kind) == "npu":
            return self.provider
        if self._cpu_provider is None:
            self._cpu_provider = OrtCpuProvider(self.options.intra_op_threads, pool=self.options.ort_pool)
        return self._cpu_provider

    def _shape_for(self, provider: Provider, kind: str) -> str:
        if self.any_rows:
            return "2d"
        if self.shape != "auto":
            return self.shape
        from hetero.npu.shapes import recorded_shape

        return recorded_shape(provider.name, kind, self.chunk)

    def _prepare_layers(self, layers: list[int], use_cache: bool) -> None:
        """Every layer's graphs loaded (or built) into `_programs`. On the CPU EP, layers after the first on a few
        threads: a session's creation (reading, checking and prepacking its weights) runs mostly without the GIL, and
        at start-up the other cores are idle (30 layer graphs: 0.2 s on one core). The first layer alone,
        so that what the process makes once (the shared ONNX Runtime pool, cached keys) is made before."""
        workers = min(PREPARE_THREADS, os.cpu_count() or 1) if isinstance(self.provider, OrtCpuProvider) else 1
        arrays = self.model.arrays()  # the float norms and biases at rest (numpy: no torch on a warm start)
        bar = progress.bar(len(layers), "graphs", "layer")

        def prepare(layer: int) -> LayerProgram:
            program = self._prepare_layer(layer, use_cache, arrays)
            bar.update()
            return program

        if layers:
            self._programs[layers[0]] = prepare(layers[0])
        rest = layers[1:]
        if workers > 1 and len(rest) > 1:
            with ThreadPoolExecutor(workers, thread_name_prefix="hetero-graphs") as pool:
                programs = list(pool.map(prepare, rest))
            self.report.rows.sort(key=lambda row: row[0])  # by layer, each layer's graphs in their order (stable)
        else:
            programs = [prepare(layer) for layer in rest]
        bar.close()
        self._programs.update(zip(rest, programs))

    def _prepare_layer(self, layer: int, use_cache: bool, arrays: dict[str, np.ndarray]) -> LayerProgram:
        shadow = frozenset(s for s in SITES if self.plan.sites[(layer, s)].shadow)
        lq = segments.layer_q(self.cfg, arrays, self.plan, layer)
        digest = segments.layer_digest(lq)
        graphs = []
        if self.fused:  # its shadows are inside the graphs
            ffn_ops = "down_in" not in shadow  # (`export._down_input`, `export._rotated_input`)
            ops = ("layer_qkv", *(("layer_o_ffn",) if ffn_ops else ())) if self.native_ops else ()
            specs = (segments.layer_halves(layer, set(shadow), bool(self._rotate_a), ops) if self.attention is not None
                     else [segments.layer_graph(layer, set(shadow), segments.AttnSpec.of(self.cfg, layer))])
            runs = []
            for spec in specs:
                g, info = prepare_graph(spec, lq, self.model.fingerprint, self.provider, use_cache, digest,
                                        self.options.graphs_root)
                self.report.rows.append((layer, spec.kind, self.provider.name, info.cached, info.seconds,
                                         info.size_bytes))
                runs.append(GraphRun(g, None))
            return LayerProgram(layer, tuple(runs))
        for spec0 in segments.layer_segments(layer, set(shadow), self.chunk, "cpu"):
            provider = self._provider_for(layer, "qkv" if spec0.kind == "qkv" else "o_ffn")
            rows = segments.DYNAMIC_ROWS if self.any_rows else self.chunk
            spec = segments.SegmentSpec(layer, spec0.kind, spec0.pieces, rows, provider.flavor,
                                        self._shape_for(provider, spec0.kind), spec0.emit_x)
            g, info = prepare_graph(spec, lq, self.model.fingerprint, provider, use_cache, digest,
                                    self.options.graphs_root)
            graphs.append(g)
            self.report.rows.append((layer, spec.kind, provider.name, info.cached, info.seconds, info.size_bytes))
        post = np.array(lq.post_ffn_norm) if lq.post_ffn_norm is not None else None  # (a writable copy: torch reads it)
        return layer_program(layer, graphs, shadow, post, self.cfg.rms_eps)

    def layer(self, layer: int, h: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int,
              rope: tuple[np.ndarray, np.ndarray], out: np.ndarray,
              qk_norm: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """A fused backend's whole layer on a chunk's real rows h [n, hidden] at positions start..start+n-1: one graph
        run, or two around the BF16 attention kernel (`self.attention`); K/V written into k_cache/v_cache
        [n_kv, capacity, D] (one layer's, contiguous) in place, as `attention.ChunkAttention` writes them; rope: the
        layer's (cos, sin) table (`attention.ChunkAttention.tables`); qk_norm: a QK-norm model's (q_norm, k_norm) of
        the layer, which the BF16 kernel applies (the GroupQueryAttention node cannot: `attention.gqa_supported`).
        Returns out [n, hidden]. Every buffer a C-contiguous float32 numpy array."""
        if not self.fused:
            raise ConfigError("layer() runs whole-layer graphs: this backend runs segments (GraphOptions.fused)")
        n = h.shape[0]
        if self.attention is not None:  # qkv graph → the BF16 kernel (K/V into the cache) → o/FFN graph
            qkv, a = self._between(n)
            self.layer_attn(layer, h, k_cache, v_cache, start, rope, qkv, a, qk_norm)  # (checks the rows, the cache)
            return self.layer_ffn(layer, a, h, out)
        if start + n > min(k_cache.shape[1], rope[0].shape[0]):
            raise ConfigError(f"chunk rows {start}..{start + n} exceed the cache ({k_cache.shape[1]}) or RoPE table "
                              f"({rope[0].shape[0]}) positions")
        if n == 1 and start + 2 <= min(k_cache.shape[1], rope[0].shape[0]):  # the graph's GroupQueryAttention
            return row_twice(h, k_cache, v_cache, start, out,
                             lambda x, y: self.layer(layer, x, k_cache, v_cache, start, rope, y))
        graph = self.program(layer).runs[0].graph
        f32, b = np.float32, graph.binding
        b.bind_input(Buffer.H, "cpu", 0, f32, (n, self.cfg.hidden), f32_address(h, "layer(): h"))
        b.bind_output(Buffer.H_OUT, "cpu", 0, f32, (n, self.cfg.hidden), f32_address(out, "layer(): out"))
        for name, t in (("past_key", k_cache), ("past_value", v_cache)):
            ptr = f32_address(t, f"layer(): the {name.replace('past_', '')} cache")
            b.bind_input(name, "cpu", 0, f32, (1, *t.shape), ptr)
            b.bind_output(name.replace("past", "present"), "cpu", 0, f32, (1, *t.shape), ptr)
        b.bind_cpu_input("seqlens_k", np.array([start + n - 1], dtype=np.int32))
        b.bind_cpu_input("total_len", np.array(start + n, dtype=np.int32))
        for name, t in zip(("cos", "sin"), rope):
            b.bind_input(name, "cpu", 0, f32, tuple(t.shape), f32_address(t, f"layer(): the RoPE {name} table"))
        graph.session.run_with_iobinding(b)
        return out

    def layer_attn(self, layer: int, h: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start: int,
                   rope: tuple[np.ndarray, np.ndarray], qkv: np.ndarray, a: np.ndarray,
                   qk_norm: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """The first half of `layer` where the BF16 kernel runs (`npu.nodes.HALF_PLACEMENT`): the q|k|v graph into
        qkv [n, q_dim + 2·kv_dim], then the attention (QK-norm and RoPE of the layer's `rope` table first), which
        writes the chunk's K/V into the cache and a [n, q_dim]."""
        if self.attention is None:
            raise ConfigError(f"layer_attn() runs the attention kernel between two graphs; this backend has none "
                              f"({self.attention_why})")
        n = h.shape[0]
        if start + n > min(k_cache.shape[1], rope[0].shape[0]):
            raise ConfigError(f"chunk rows {start}..{start + n} exceed the cache ({k_cache.shape[1]}) or RoPE table "
                              f"({rope[0].shape[0]}) positions")
        self.program(layer).runs[0].graph.run({Buffer.H: h}, {Buffer.QKV: qkv})
        return self.attention(qkv, k_cache, v_cache, start, rope[0], rope[1], a, self.cfg.window(layer), self._rotate_a,
                              qk_norm)

    def layer_ffn(self, layer: int, a: np.ndarray, h: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The second half: the o→FFN graph on the attention's output a and the layer's input h, into out."""
        if self.attention is None:
            raise ConfigError("layer_ffn() is the half after the attention kernel; this backend runs whole layers")
        self.program(layer).runs[1].graph.run({Buffer.A: a, Buffer.H: h}, {Buffer.H_OUT: out})
        return out

    def layer_attn_at(self, layer: int, n: int, h: int, qkv: int, a: int, k_cache: int, v_cache: int, capacity: int,
                      start: int, cos: int, sin: int) -> None:
        """`layer_attn` on the addresses of buffers laid out as it checks them, unchecked (`npu.nodes.HalvesAt` checks
        a prompt's buffers once: per layer and chunk, checking and taking their addresses again cost ~20 µs, 4% of a
        64-token prefill; docs/journal.md, "Issue 24 (session 16)"). k_cache/v_cache: the layer's [n_kv, capacity,
        D]; cos/sin: row 0 of the RoPE table (rows are positions); a model whose layers differ in their table or QK-norm
        runs the checked calls (`HalvesAt.of`)."""
        self.program(layer).runs[0].graph.run_at(n, (h, qkv))
        self.attention.at(qkv, n, k_cache, v_cache, capacity, start, cos, sin, a, self.cfg.window(layer), self._rotate_a)

    def layer_ffn_at(self, layer: int, n: int, a: int, h: int, out: int) -> None:
        """`layer_ffn` on addresses (`layer_attn_at`); the graph's inputs are a, then h (`segments.segment_io`)."""
        self.program(layer).runs[1].graph.run_at(n, (a, h, out))

    def _between(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """This lane thread's q|k|v [n, ·] and attention output [n, q_dim] rows (grown to the most rows seen)."""
        s = self._scratch
        if getattr(s, "rows", 0) < n:
            s.qkv, s.a = buffers.empty((n, self.cfg.q_dim + 2 * self.cfg.kv_dim)), buffers.empty((n, self.cfg.q_dim))
            s.rows = n
        return s.qkv[:n], s.a[:n]

    # --------------------------------------------------------------------------- LayerBackend
    def bind(self, job: Job) -> nodes.NpuNodes:
        """Its nodes bound to a prefill (`LayerBackend.bind`); the halves on addresses checked once per prompt where
        they can (`npu.nodes.HalvesAt`)."""
        return nodes.NpuNodes(self, job)

    def qkv(self, layer: int, h: np.ndarray, out: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.fused:  # the same plan's segments (a layer-by-layer forward: `model.forward`, the accuracy bench)
            return self.at_chunk(self.chunk).qkv(layer, h, out)
        first = self.program(layer).runs[0]
        if out is None:
            out = buffers.empty((h.shape[0], self.cfg.q_dim + 2 * self.cfg.kv_dim))
        env = first.run({Buffer.H: h}, {Buffer.QKV: out})  # [C, q_dim + 2·kv_dim]; q/k/v are views
        if first.shadow is not None:
            first.shadow.apply(env, self.shadow_delta(layer, first.shadow.site, env[first.shadow.source]))
        qd, kd = self.cfg.q_dim, self.cfg.kv_dim
        return out[:, :qd], out[:, qd : qd + kd], out[:, qd + kd :]

    def o_ffn(self, layer: int, a: np.ndarray, h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if self.fused:
            return self.at_chunk(self.chunk).o_ffn(layer, a, h, out)
        if out is None:
            out = buffers.empty((h.shape[0], self.cfg.hidden))
        env: dict[str, np.ndarray] = {Buffer.A: a, Buffer.H: h}
        d_extra = None
        for run in self.program(layer).runs[1:]:
            env.update(run.run(env, {Buffer.H_OUT: out}))
            if run.shadow is not None:
                extra = run.shadow.apply(env, self.shadow_delta(layer, run.shadow.site, env[run.shadow.source]))
                if extra is not None:  # down_in's, added to d below
                    d_extra = extra
        if Buffer.D in env:  # a separate down graph: h1 + (d + shadow), the reference's order
            d = env[Buffer.D]
            if d_extra is not None:
                d += d_extra
            return self.program(layer).finish(env[Buffer.H1], d, out)
        return out
