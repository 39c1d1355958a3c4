"""A decode step: a few tokens (one, or a token tree) through every layer over a runtime's KV cache.

Static subgraphs run on the runtime's backend; an INT8 backend built for prefill chunks (C = 256) is
rebuilt at the small decode sizes (C = 1 and the tree sizes) from the same quantization plan and the
same graph cache. Attention runs on the CPU lane with per-row positions and the tree mask. K/V of the
rows are written in place at cache rows `length .. length+n-1`; the caller decides what stays.

Hidden rows and logits are numpy. The INT8 lane (`bound_step.BoundStep`, the heads of `head`) imports no torch;
the float lane (`FloatLayers`, `head.FloatHead`) runs torch's float math, imported when it runs.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol
from contextlib import nullcontext

import numpy as np

from hetero.decode.gemv_step import SPLIT_LINEARS, GemvHead, GemvStep, GemvWeights
from hetero.decode.gguf_blocks import BlockWeights
from hetero.decode.stepcosts import load_costs, save_costs
from hetero.decode.tree import TokenTree
from hetero.errors import ConfigError
from hetero.kv_cache import KVCache
from hetero.npu.graph_backend import NpuBackend
from hetero.runtime import Runtime
from hetero.threads import torch_threads

if TYPE_CHECKING:
    from hetero.decode.bound_step import BoundStep
    from hetero.decode.twocore.attnpool import AttentionPool
    from hetero.model import LayerBackend


TREE_SIZES = (1, 2, 4, 8)  # static chunk sizes of the INT8 decode graphs (2: a one-token draft, LLMCad §3.3)
# Threads of an INT8 decode step (its graph sessions, and torch's while it runs where torch is loaded). A step is
# ~150 small ops (graph runs, per-layer attention, shadow corrections) of a few to ~80 µs each; with two threads
# each op wakes a sleeping pool thread (neither pool spins: `npu.providers`, `hetero.threads`), which costs more
# than the second core's extra memory bandwidth gains (docs/design.md, "Decode").
DECODE_THREADS = 1
# One-row steps a `DecodeStep` runs before it splits its graphs over both cores (`BoundStep.split`): the split costs
# ~1 s once and saves ~2 ms a step at context 1024 (docs/design.md, "Decoding"), so a short answer (`hetero run`'s
# 64 tokens) never pays for it and a long decode or a server does after a few hundred tokens.
SPLIT_AFTER_STEPS = 256


class Layers(Protocol):
    """A step's layers at one chunk size: the hidden states [C, hidden] of a tree's rows (padded to C with the
    root) after `layers` layers (default all), their K/V written to cache rows slot.. (cache.length unchanged).
    Two implementations: `bound_step.BoundStep` (the INT8 graphs, bound once) and `FloatLayers` (the float layer)."""

    def forward(self, cache: KVCache, tree: TokenTree, slot: int, layers: int | None = None) -> np.ndarray: ...


class FloatLayers:
    """The float layer (`hetero.model`) over a tree's rows, with the per-row attention of decode (`rowattn`): torch's
    float math on views of the numpy cache, the hidden rows handed back as numpy.

    The linears run one row at a time: torch's GEMM over n rows takes other kernels (and sums in another order) than
    its GEMV over one, which moved a tree row's logits by ~1.5e-5 from the one-row step of its token, enough to flip
    a near-tie; a row at a time, a tree's rows are the one-row steps bit for bit."""

    def __init__(self, runtime: Runtime, backend: LayerBackend):
        self.runtime, self.backend, self.cfg = runtime, backend, runtime.cfg

    def forward(self, cache: KVCache, tree: TokenTree, slot: int, layers: int | None = None) -> np.ndarray:
        import torch

        from hetero import model as ref
        from hetero.decode.rowattn import row_attention

        n = len(tree)
        backend = ref.on_tensors(self.backend)  # a numpy backend through torch views
        with torch.inference_mode():
            h = ref.embed(self.runtime.model.weights, torch.tensor(tree.tokens, dtype=torch.long))
            positions = torch.from_numpy(tree.positions(slot))
            mask = None if tree.is_chain() else torch.from_numpy(tree.mask())
            for layer in range(self.cfg.n_layers if layers is None else layers):
                q, k, v = (torch.cat(parts) for parts in zip(*(backend.qkv(layer, h[i : i + 1]) for i in range(n))))
                base = cache.place(layer, slot, n)  # a windowed layer keeps its window (`KVCache.place`)
                kc, vc = (torch.from_numpy(x) for x in cache.layer(layer))
                a = ref.attention(self.cfg, q, k, v, self.runtime.rope, kc, vc, slot, n, positions, mask,
                                  row_attention, layer=layer, lw=self.runtime.model.weights.layers[layer], base=base)
                h = torch.cat([backend.o_ffn(layer, a[i : i + 1], h[i : i + 1]) for i in range(n)])
            return h.contiguous().numpy()


class DecodeStep:
    """Forward passes of decode-sized chunks for one runtime (`DecodeStep.of(runtime)`: the runtime's own).

    A step is its layers (`Layers`: the INT8 graphs bound once, `bound_step.BoundStep`, or the float layer,
    `FloatLayers`) and its head (`head.FloatHead`, `head.Int8Head`, or `head.NbitsHead` beside MatMulNBits layers,
    `npu.nbits`): hidden states, then logits."""

    def __init__(self, runtime: Runtime, head: str = "auto", threads: int = DECODE_THREADS,
                 attention_threads: int | None = None, split_after: int | None = SPLIT_AFTER_STEPS,
                 small_rows: int | None = None, kernel: str = "auto"):
        """split_after: one-row steps before the graphs split over both cores (0: at the first, None: never).
        small_rows: steps of up to this many rows run MatMulNBits' form (`npu.nbits`) instead of the INT8 graphs
        (0: none; None: as the runtime's decode placement says, `DecodePlacement.small_rows`). kernel: what runs
        those steps: "gemv" (hetero's int8 GEMVs, `native.gemv`; refused with the reason where they cannot run),
        "blocks" (the same kernels over the GGUF's own Q4_1 / Q8_0 blocks, `gguf_blocks`; likewise), "nbits" (ONNX
        Runtime's MatMulNBits graphs), "auto" (the host plan's decode kernel, `DecodePlacement.small_kernel`,
        decided at the edge; "nbits" for a runtime without a placement). The "blocks" steps run in the model's own
        space and take the head of their weights (`gguf_blocks`): other heads are refused beside them."""
        if threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        if attention_threads is None:  # the runtime's plan: a helper thread where the process may use two cores and
            # no shared ONNX Runtime pool spins beside it (`threads.ExecutionPlan.decode_helper`)
            attention_threads = 2 if runtime.execution.decode_helper else 1
        if attention_threads not in (1, 2):
            raise ConfigError(f"attention_threads must be 1 or 2, got {attention_threads}")
        self.runtime, self.cfg, self.model = runtime, runtime.cfg, runtime.model
        self.static = isinstance(runtime.backend, NpuBackend)  # prebuilt graphs of fixed chunk sizes
        self.threads = threads  # the INT8 lane's (the float lane keeps the runtime's: its step is a few big GEMVs)
        self._backends: dict[int, LayerBackend] = {}
        # the decode placement: an INT8 lane's graphs on the engine the runtime chose (the CPU EP
        # for a prefill on an NPU); None: the prefill backend's own provider
        placed = runtime.decode if self.static else None
        own = placed is None or placed.engine == runtime.backend.provider.name
        self._engine: str | None = None if own else placed.engine
        if small_rows is None:
            small_rows = placed.small_rows if placed is not None else 0
        self.small_rows = small_rows if self.static else 0
        self.kernel = self._kernel(kernel, placed.small_kernel if placed is not None else "nbits")
        self._gemv: GemvWeights | BlockWeights | None = None  # the GEMVs' weights (the layers' arena, the head's)
        self._small: LayerBackend | None = None  # the MatMulNBits graphs (rows symbolic: one set for every small size)
        self.costs: dict[int, float] = {}  # chunk size → measured ms of a step (shared by decodes)
        self._bound: dict[int, BoundStep | GemvStep] = {}  # static lanes: chunk size → its bound graphs
        # One step at a time: its buffers, bindings and helper serve one forward pass. `Runtime.prefill` has its own
        # lock; this one covers the runtime's decoding, so threads that share a runtime decode in turn.
        self._lock = threading.RLock()
        self.split_after = split_after
        self.one_row_steps = 0
        # the helper thread, started by the first step that uses it (`pool`): a prefill's last token reads the head
        # only, and a process that only prefills starts no thread and loads no numba (`gemv_step`)
        self._two_threads = self.static and attention_threads == 2
        self._pool: AttentionPool | None = None
        if head == "auto":  # the INT8 lane's: the small steps' form (GEMVs or MatMulNBits, `npu.nbits`), else INT8
            head = ((self.kernel if self.small_rows else "int8") if self.static else "float")
        if (head == "blocks") != (self.kernel == "blocks" and self.static):
            raise ConfigError(f"a {head} head cannot read the {self.kernel} steps' hidden rows: the GGUF block steps "
                              f"and their head run in the model's own space, the others in the runtime's")
        # hidden rows of the runtime's own space (its prefill's, the INT8 graphs' steps) → the head's (`gguf_blocks`)
        self._unrotate: np.ndarray | None = None
        if head == "blocks":
            self.head = GemvHead(self._gemv_weights(), self.pool if SPLIT_LINEARS else None)
            self._unrotate = self._gemv_weights().unrotate
        elif head == "gemv":
            if self.kernel != "gemv":  # asked for beside the graphs: only where the kernels run on an INT8 lane
                from hetero.native import gemv

                why = "a float lane has no quantized weights" if not self.static else gemv.unavailable(self.cfg)
                if why is not None:
                    raise ConfigError(f"hetero's int8 GEMV head cannot run here: {why}")
            self.head = GemvHead(self._gemv_weights(), self.pool if SPLIT_LINEARS else None)
        elif head == "nbits":
            from hetero.decode.head import NbitsHead

            self.head = NbitsHead(self.cfg, self.model, threads, self.pool, runtime.execution.ort_pool)
        elif head == "int8":
            from hetero.decode.head import Int8Head

            self.head = Int8Head(self.cfg, self.model.arrays(), threads, self.pool, self.model,
                                 runtime.execution.ort_pool)
        else:
            from hetero.decode.head import FloatHead

            self.head = FloatHead(self.cfg, self.model.weights)

    def row_unexact(self) -> str | None:
        """Why a token tree's rows are not computed exactly as one-row steps of their tokens here, or None when they
        are (so verifying a drafted tree emits plain greedy's tokens, bit for bit: `generate.speculation`). Measured
        exact: the INT8 graphs, hetero's int8 GEMVs, the INT8 head, the float layer and head a row at a time, the
        attention kernel (`rowattn`, one compiled copy on either thread); tests/decode/test_determinism.py."""
        if self.static and ((self.small_rows > 1 and self.kernel == "nbits") or self.head.name == "nbits"):
            return ("ONNX Runtime's MatMulNBits kernels compute a row of a multi-row step otherwise than a one-row "
                    "step (tree rows were up to 0.5 off in logits)")
        return None

    def _kernel(self, kernel: str, placed: str) -> str:
        """What runs the small steps (`__init__`'s kernel): "gemv", "blocks" or "nbits". "auto" takes the plan's
        (`placed`) as decided; only a kernel asked for here is checked."""
        if kernel not in ("auto", "gemv", "blocks", "nbits"):
            raise ConfigError(f"kernel must be 'auto', 'gemv', 'blocks' or 'nbits', got {kernel!r}")
        if not self.small_rows:
            return "nbits"
        if kernel == "auto":
            return placed
        if kernel in ("gemv", "blocks"):
            from hetero.native import gemv, gguf_forms

            why = gemv.unavailable(self.cfg) or (gguf_forms.unavailable(self.model) if kernel == "blocks" else None)
            if why is not None:
                what = "int8 GEMVs" if kernel == "gemv" else "GEMVs over the GGUF's own blocks"
                raise ConfigError(f"hetero's {what} cannot run here: {why}")
        return kernel

    def _gemv_weights(self) -> GemvWeights | BlockWeights:
        """The GEMVs' weights of the runtime's model: the GGUF's blocks ("blocks"), else the INT8 form with its plan's
        online transforms; one arena per runtime, shared by its decode steps."""
        if self._gemv is None:
            made = getattr(self.runtime.decode, "made", None)
            key = "decode-block-weights" + (f"-{made}" if made else "")
            self._gemv = (self.runtime.owned(key, lambda: BlockWeights(self.model, made))
                          if self.kernel == "blocks" else
                          self.runtime.owned("decode-gemv-weights",
                                             lambda: GemvWeights(self.model, self.runtime.backend.plan.online)))
        return self._gemv

    @classmethod
    def of(cls, runtime: Runtime) -> "DecodeStep":
        """The runtime's own step (made once, closed by `Runtime.close`): decodes share its bound graphs and costs."""
        return runtime.owned("decode-step", lambda: cls(runtime))

    @property
    def pool(self) -> "AttentionPool | None":
        """The helper thread of a two-thread step (`twocore.attnpool`), started at first use; None on one thread."""
        if self._pool is None and self._two_threads:
            from hetero.decode.twocore.attnpool import AttentionPool

            self._pool = AttentionPool()
            weakref.finalize(self, self._pool.close)  # the helper thread ends with this step object
        return self._pool

    def close(self) -> None:
        """Stop the helper thread (a step made directly is also stopped when it is collected)."""
        if self._pool is not None:
            self._pool.close()

    def logits(self, h: np.ndarray) -> np.ndarray:
        """The head's logits of hidden rows h [n, hidden] outside a step (an INT8 runtime's prefill ends with its last
        token's, `methods.make_runtime`: one head per runtime), in turn with the steps of other threads."""
        with self._lock:
            return self.head(self._head_rows(h))

    def _head_rows(self, h: np.ndarray) -> np.ndarray:
        """Hidden rows of the runtime's own space in the head's (`_unrotate`; most heads: the same)."""
        return h if self._unrotate is None or np.size(h) == 0 else np.asarray(h, np.float32) @ self._unrotate

    def padded_size(self, n: int) -> int:
        if not self.static:
            return n
        return next((c for c in TREE_SIZES if c >= n), n)

    def backend(self, n: int) -> LayerBackend:
        """The layer backend for a chunk of n rows (padded up to a prepared size on a static lane)."""
        if not self.static:
            return self.runtime.backend
        c = self.padded_size(n)
        b = self._backends.get(c)
        if b is None:
            b = self._small_backend() if c <= self.small_rows else self.runtime.backend.at_chunk(c, self.threads,
                                                                                              self._engine)
            self._backends[c] = b
        return b

    def _small_backend(self) -> LayerBackend:
        """The MatMulNBits graphs of the runtime's model (`npu.nbits`), its plan's online transforms, made once."""
        if self._small is None:
            from hetero.npu.nbits import NbitsBackend
            from hetero.npu.providers import OrtCpuProvider

            be = self.runtime.backend
            self._small = NbitsBackend(self.model, be.plan.online, OrtCpuProvider(self.threads, pool=be.options.ort_pool),
                                       layers=be.layers)
        return self._small

    @property
    def costs_key(self) -> str:
        """What the measured step costs depend on: the model, its backend's graphs (the plan's site table) and
        the threads (`stepcosts`; the host is in the file name)."""
        plan = getattr(self.runtime.backend, "plan", None)
        digest = "" if plan is None else hashlib.sha256(json.dumps(plan.to_dict(), sort_keys=True).encode()).hexdigest()
        return (f"{self.model.name}-{self.model.fingerprint[:12]}-{self.runtime.backend.name}-{digest[:12]}-"
                f"t{self.threads}-a{2 if self._two_threads else 1}-{self.head.__class__.__name__}"
                + (f"-{self.kernel}{self.small_rows}" if self.small_rows else ""))

    def prepare(self, n: int) -> BoundStep | GemvStep | None:
        """The bound graphs of a chunk of n rows on a static lane, bound at first use (None on a float lane)."""
        if not self.static:
            return None
        with self._lock:
            return self._prepare(n)

    def _prepare(self, n: int) -> BoundStep | GemvStep:
        c = self.padded_size(n)
        bound = self._bound.get(c)
        if bound is None and c <= self.small_rows and self.kernel in ("gemv", "blocks"):
            w = self._gemv_weights()
            bound = self._bound[c] = GemvStep(w, w.arrays, self.runtime.rope, c, self.pool)
        elif bound is None:
            from hetero.decode.bound_step import BoundStep

            bound = self._bound[c] = BoundStep(self.backend(c), self.runtime.rope, c, self.pool)
        if c == 1 and self.split_after is not None and self.one_row_steps >= self.split_after:
            if bound.split() and self.head.name == "nbits":
                self.head.split()
        return bound

    def measure(self, cache: KVCache, sizes: Sequence[int] = TREE_SIZES) -> dict[int, float]:
        """The step cost of each chunk size: stored ones (`stepcosts`, measured by an earlier process on this
        host), else timed now (rows past cache.length: scratch, unchanged length) and stored."""
        if not self.costs:
            self.costs.update(load_costs(self.costs_key))
        room = self.cfg.context_length - cache.length  # scratch rows past the cache must fit in the context
        missing = [c for c in sizes if c not in self.costs and c <= room]
        for c in missing:
            if c not in self.costs:
                tree = TokenTree.chain([self.cfg.bos_token_id or 0] * c)
                for _ in range(2):  # warm-up (first-run allocations)
                    self.forward(cache, tree)
                times = []
                for _ in range(5):  # the least of five: one run on a shared machine can be a multiple
                    t0 = time.perf_counter()
                    self.forward(cache, tree)
                    times.append((time.perf_counter() - t0) * 1e3)
                self.costs[c] = min(times)
        if missing:
            self.save_costs()
        return self.costs

    def save_costs(self) -> None:
        """Store the step costs for the next process (`stepcosts`)."""
        save_costs(self.costs_key, self.costs)

    def forward(self, cache: KVCache, tree: TokenTree, *, slot: int | None = None, layers: int | None = None,
                rows: Sequence[int] | None = None) -> np.ndarray:
        """Logits [len(rows), vocab] (float32) of the tree's rows (default all) after `layers` layers (default all).

        K/V go to cache rows slot..slot+n-1 (default slot = cache.length); the tree's root is at
        position `slot` (its depth 0). `cache.length` is not changed. Threads sharing the step run in turn.
        """
        with self._lock, torch_threads(self.threads) if self.static else nullcontext():
            return self._forward(cache, tree, slot, layers, rows)

    def _forward(self, cache: KVCache, tree: TokenTree, slot: int | None, layers: int | None,
                 rows: Sequence[int] | None) -> np.ndarray:
        """The step's two parts: the layers (`Layers.forward` → hidden states) and the head (→ logits)."""
        n = len(tree)
        slot = cache.length if slot is None else slot
        cache.reserve(slot + n - cache.length)
        layers_of_size = self.prepare(n) if self.static else FloatLayers(self.runtime, self.backend(n))
        self.one_row_steps += self.padded_size(n) == 1
        try:
            h = layers_of_size.forward(cache, tree, slot, layers)
            return self._logits(h if isinstance(layers_of_size, GemvStep) else self._head_rows(h), n, rows)
        finally:
            if self._pool is not None:
                self._pool.end()

    def _logits(self, h: np.ndarray, n: int, rows: Sequence[int] | None) -> np.ndarray:
        sel = h[:n] if rows is None else h[list(rows)]
        if sel.shape[0] == 0:  # K/V only (a draft model catching up)
            return np.empty((0, self.cfg.vocab), np.float32)
        return self.head(sel)


def step_logits(runtime: Runtime, h: np.ndarray) -> np.ndarray:
    """The logits of hidden rows h [n, hidden] through the head of the runtime's own decode step (`DecodeStep.of`,
    made at the first call): an INT8 runtime's LM head (`Runtime`'s head, `methods.make_runtime`), so that its prefill
    and its decode load one head."""
    return DecodeStep.of(runtime).logits(h)
