"""Decode steps whose linears are hetero's own int8 GEMVs (`native.gemv`, AVX-512 VNNI), and the LM head likewise.

The same form as the MatMulNBits graphs (`npu.nbits`: the method's float weights, the rotated copy's for the default,
W·T on online sites, quantized by ONNX Runtime's kernel to 8 bits in blocks of 128; activations int8 per block of 32
at run time; no shadow corrections), computed without a graph: per layer one call for q|k|v (RMSNorm in front) and one
for o → FFN (o_in's online Hadamard, o, the residual, RMSNorm, gate|up, act(gate)·up, down_in's online Hadamard, down,
the residual; Gemma 3's post-norms between those jobs, `GemvStep._post_norms`), attention between them as in
`bound_step` (`rowattn.decode_rows`, or both threads through `twocore.attnpool`). The same step and head run over the
GGUF's own Q4_1 / Q8_0 blocks where the model's file has them (`gguf_blocks.BlockWeights`, the same interface: in the
model's unrotated space, no online transforms). The layers' weights lie in one arena in the order a step reads it (the
head in its own, `StepLinears`), so the step streams one run of memory on huge pages (separate arrays of ~1 MB each
streamed at ~13-20 GB/s on AMD EPYC Zen 4, the arena ~26 GB/s from one thread:
docs/journal.md, "Issue 24 item 3 (session 15)").

Beside the helper thread (`attnpool.AttentionPool`) the step shares each layer's attention heads with it. Its linears
can run on both cores too (`split`: each linear one stage of the pool's stage runner, both threads claiming column
tiles), but here they run on this thread (`SPLIT_LINEARS`): one thread streams the arena at ~26 GB/s of the ~32 both
give, and 121 stage hand-offs a step cost more than the rest gains (AMD EPYC Zen 4, steps interleaved in one
process: 6.45 / 7.70 / 10.06 ms at context 256 / 1024 / 2048 against 6.61 / 7.93 / 10.37 split, docs/journal.md).
A column's value depends neither on the split nor on the other rows, so a split step's logits equal the one-thread
step's, and a tree row equals the plain step of its token, bit for bit (tested).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hetero import buffers
from hetero.attention import qk_norm_
from hetero.decode.tree import TokenTree
from hetero.errors import ConfigError
from hetero.kv_cache import KVCache
from hetero.loader import PageReturn
from hetero.native import gemv
from hetero.npu.nbits import COLUMN_BLOCK, NbitsForm, quantize_weight, site_bias, site_weight
from hetero.outliers.weightcache import cached_arrays
from hetero.rope import RopeTable
from hetero.tensorfile import LazyTensors, Put
from hetero.weights import SITE_BIASES, SITE_LINEARS

if TYPE_CHECKING:
    from hetero.decode.twocore.attnpool import AttentionPool, StageTable
    from hetero.loader import Model

# The step's attention and helper thread are numba code (`rowattn`, `twocore.attnpool`), imported by the step when
# it runs: the LM head and the weights are not, so a process that only prefills (its last token's logits through the
# head) never loads numba and LLVM (68 MB of pages here).

SITES = ("attn_in", "o_in", "ffn_in", "down_in")  # a layer's linears, in the order a step runs them
SPLIT_LINEARS = False  # the linears' column tiles shared with the helper thread (module docstring: not on this host)
FORM = NbitsForm(8, gemv.QB, 4, True)  # the weights' form: MatMulNBits' default (`npu.nbits.DEFAULT_FORM`)


class GemvWeights:
    """Every layer's linears and the LM head in the kernel's form (`gemv.Packed`), their weight bytes in arenas in
    step order (`StepLinears`); computed once from the model's float weights and kept beside its cache entry
    (`outliers.weightcache.cached_arrays`), so a warm start reads them and never imports torch."""

    def __init__(self, model: "Model", online: dict[str, int]):
        cfg = model.config
        why = gemv.config_unsupported(cfg)
        if why is not None:
            raise ConfigError(f"hetero's int8 GEMVs cannot run this model: it has {why}")
        self.cfg, self.online = cfg, dict(online)
        form = {"gemv": gemv.GEMV_VERSION, "block": gemv.QB, "online": sorted([str(k), int(v)] for k, v in online.items())}
        found = cached_arrays(model, "gemv8", form, lambda: _packed(model, self.online))
        self.linears = StepLinears(cfg, found, {name: "int8" for name in step_names(cfg)})
        self.biases = {name: np.array(found[f"{name}.bias"], np.float32) for name in step_names(cfg)
                       if f"{name}.bias" in found}
        arrays = model.arrays()
        self.arrays = arrays  # the embedding rows and QK norms a step reads (the model's, rotated with these weights)
        self.norms = step_norms(cfg, arrays)
        self.unrotate = None  # a step's hidden rows are the runtime's own (`gguf_blocks.BlockWeights.unrotate`)

    @property
    def nbytes(self) -> int:
        return self.linears.nbytes

    def close(self) -> None:
        """Nothing to release beyond memory (a runtime's owned object, `Runtime.owned`): the arena goes with the last
        step that holds it."""


def _dims(cfg) -> dict[str, tuple[int, int]]:
    """(K, N) of each site's linear and of the head."""
    return {"attn_in": (cfg.hidden, cfg.q_dim + 2 * cfg.kv_dim), "o_in": (cfg.q_dim, cfg.hidden),
            "ffn_in": (cfg.hidden, 2 * cfg.ffn), "down_in": (cfg.ffn, cfg.hidden), "head": (cfg.hidden, cfg.vocab)}


def _packed(model: "Model", online: dict[str, int]) -> LazyTensors:
    """Every linear's and the head's packed weights (`gemv.Packed`'s w and ws) and the sites' biases, made a block
    of output columns at a time (`COLUMN_BLOCK`) and handed over as they are made (`tensorfile.write_tensors`
    writes them to the cache file piece by piece): no site is ever whole in float, nor the head transposed to
    float32 (1.05 GB at 1B width, and the quantizer's padded copy as much again), and the float weights read
    give back their mapped pages (`PageReturn`)."""
    cfg, weights = model.config, model.weights
    dims = _dims(cfg)
    names = [(f"{layer}.{site}", site) for layer in range(cfg.n_layers) for site in SITES] + [("head", "head")]
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, np.dtype] = {}
    for name, site in names:
        shapes[f"{name}.w"], shapes[f"{name}.ws"] = gemv.packed_shapes(*dims[site])
        dtypes[f"{name}.w"] = np.dtype(np.uint8)
        if site != "head" and any(getattr(weights.layers[int(name.split(".")[0])], b) is not None
                                  for b in SITE_BIASES[site]):
            shapes[f"{name}.bias"] = (dims[site][1],)

    def pieces(put: Put) -> None:
        read = PageReturn()  # a packed float weight need not stay resident
        head = model.arrays()["lm_head"]
        for name, site in names:
            k, n = dims[site]
            step = max(gemv.TILE, COLUMN_BLOCK // k // gemv.TILE * gemv.TILE)
            lw = None if site == "head" else weights.layers[int(name.split(".")[0])]
            for lo in range(0, n, step):
                cols = slice(lo, min(lo + step, n))
                if lw is None:  # the head [vocab, hidden]: its rows are the columns
                    w_kn = np.asarray(head[cols], np.float32).T
                    read.add(weights.lm_head[cols])
                else:
                    w_kn = site_weight(lw, SITE_LINEARS[site], online.get(site, 0), cols)
                p = gemv.pack_quantized(*quantize_weight(w_kn, FORM)[:2], k)
                put(f"{name}.w", p.w)
                put(f"{name}.ws", p.ws)
            if lw is not None:
                bias = site_bias(lw, SITE_LINEARS[site], SITE_BIASES[site])
                if bias is not None:
                    put(f"{name}.bias", bias)
                read.add(*(getattr(lw, f) for f in SITE_LINEARS[site]))
        read.flush()

    return LazyTensors(shapes, dtypes=dtypes, pieces=pieces, what="pack decode weights")


def step_names(cfg) -> list[str]:
    """The linears' names in the order a step reads them: "<layer>.<site>", then "head"."""
    return [f"{layer}.{site}" for layer in range(cfg.n_layers) for site in SITES] + ["head"]


def step_norms(cfg, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The RMSNorm weights a step reads (the final norm, each layer's two the GEMVs fold in, and its post-norms where
    the model has them), float32."""
    fields = ("attn_norm", "ffn_norm") + (("post_attn_norm", "post_ffn_norm") if cfg.post_norms else ())
    return {name: np.ascontiguousarray(arrays[name], np.float32)
            for name in ["norm"] + [f"layers.{i}.{f}" for i in range(cfg.n_layers) for f in fields]}


def place_linears(cfg, found: dict[str, np.ndarray], forms: dict[str, str],
                  names: list[str]) -> tuple[np.ndarray, dict[str, gemv.Packed]]:
    """The packed weights `found` ("<name>.w", and "<name>.ws" for the INT8 form) of the linears `names`, in the
    form `forms[name]`, copied into one arena in that order (64-byte aligned pieces): the arena and each linear's
    `gemv.Packed` over it."""
    sizes = [-(-found[f"{n}.w"].nbytes // 64) * 64 for n in names]
    arena = _arena(sum(sizes))
    linears: dict[str, gemv.Packed] = {}
    dims = _dims(cfg)
    read = PageReturn(32 << 20)  # the mapped file's pages copied into the arena need not stay resident beside it
    # (in batches small beside the arena: a 256 MB batch kept a 135M model's whole file resident beside it)
    off = 0
    for name, size in zip(names, sizes):
        w = found[f"{name}.w"]
        view = arena[off : off + w.nbytes].reshape(w.shape)
        view[...] = w
        off += size
        # copies, not views: a view would keep the whole mapped file resident beside the arena
        ws = np.array(found[f"{name}.ws"], np.float32) if forms[name] == "int8" else np.zeros(0, np.float32)
        linears[name] = gemv.Packed(view, ws, *dims[name.split(".")[-1]], forms[name])
        read.add(w)
    read.flush()
    return arena, linears


class StepLinears(Mapping[str, gemv.Packed]):
    """Every linear of a step (`step_names`) over its arena, the LM head placed at once and the layers' linears at
    their first read (one arena in step order). A prefill's last token reads only the head (`methods.runtime_of`), so
    a process that only prefills, hetero as an engine's prefill accelerator, never holds the layers' decode weights
    (the default model: 66 of its 96 MB); the first decode step places them."""

    def __init__(self, cfg, found: dict[str, np.ndarray], forms: dict[str, str]):
        self._cfg, self._found, self._forms = cfg, found, forms
        self._lock = threading.Lock()
        self.arenas: list[np.ndarray] = []
        self._placed: dict[str, gemv.Packed] = {}
        self._place(["head"])

    def _place(self, names: list[str]) -> None:
        arena, linears = place_linears(self._cfg, self._found, self._forms, names)
        self.arenas.append(arena)
        self._placed.update(linears)

    def __getitem__(self, name: str) -> gemv.Packed:
        if name not in self._placed:
            with self._lock:  # decode steps of two threads may read their first layer at once
                if self._found is not None:
                    self._place([n for n in step_names(self._cfg) if n != "head"])
                    self._found = None  # the cache file's mapping is not needed again
        return self._placed[name]

    def __iter__(self) -> Iterator[str]:
        return iter(step_names(self._cfg))

    def __len__(self) -> int:
        return len(step_names(self._cfg))

    @property
    def nbytes(self) -> int:
        """Bytes of the arenas placed so far."""
        return sum(int(a.nbytes) for a in self.arenas)


HUGE = 2 << 20  # bytes of an x86-64 huge page


def _arena(n: int) -> np.ndarray:
    """n bytes of private anonymous memory, 2 MB-aligned and advised to be backed by huge pages (a step streams all of
    it: fewer TLB misses, and the hardware prefetcher does not stop at every 4 KB page)."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    m = mmap.mmap(-1, n + HUGE, flags=flags) if flags else mmap.mmap(-1, n + HUGE)
    raw = np.frombuffer(m, np.uint8)
    off = -raw.ctypes.data % HUGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE, off, n)
        except (OSError, ValueError):  # a kernel without transparent huge pages: plain pages
            pass
    return raw[off : off + n]


@dataclass
class _Table:
    """Jobs as the kernels run them: on this thread (`run`: each whole) or as stages of the pool (`split`)."""

    jobs: list[gemv.Bound]
    whole: ctypes.Array
    parts: ctypes.Array
    split: StageTable | None
    keep: list[object] = field(default_factory=list)  # the split's parts and scratch (the table holds addresses)
    counters: np.ndarray | None = None  # the split jobs' tile counters (`gemv.Bound.halves`), zeroed before a step

    @classmethod
    def of(cls, jobs: list[gemv.Bound], scratch: tuple[gemv.Scratch, gemv.Scratch] | None) -> "_Table":
        ptrs = (ctypes.c_void_p * len(jobs))(*[ctypes.addressof(b.job) for b in jobs])
        parts = (ctypes.c_void_p * len(jobs))(*[ctypes.addressof(b.whole) for b in jobs])
        if scratch is None:
            return cls(jobs, ptrs, parts, None)
        from hetero.decode.twocore.attnpool import StageTable  # (numba: a split table only, module note)

        counters = np.zeros(8 * len(jobs), np.int64)  # one per job, a cache line each
        halves = [b.halves(*scratch, counters.ctypes.data + 64 * i) for i, b in enumerate(jobs)]
        addr = lambda xs: np.asarray([ctypes.addressof(x) for x in xs], np.int64)  # noqa: E731
        split = StageTable(gemv.part_fn(), addr([b.job for b in jobs]), addr([h[0] for h in halves]),
                           addr([b.job for b in jobs]), addr([h[1] for h in halves]), _never)
        return cls(jobs, ptrs, parts, split, [h for pair in halves for h in pair] + list(scratch), counters)

    def run(self, first: int, last: int, pool: AttentionPool | None) -> None:
        """Jobs first..last-1: their column halves on both threads when a step with the helper is in progress,
        else each whole on this thread (one C call)."""
        if pool is not None and self.split is not None and pool.active:
            self.counters[8 * first : 8 * last : 8] = 0
            pool.run_stages(self.split, first, last)
        else:
            gemv.library().hetero_gemv_run(self.whole, self.parts, first, last)


def _never(status: int) -> None:
    raise RuntimeError(f"hetero's GEMV part returned {status:#x} (it returns no status)")


class GemvStep:
    """`forward(cache, tree, slot)` → the hidden states [C, hidden] of a C-row chunk (the `step.Layers` protocol),
    every linear on hetero's GEMVs over buffers bound once."""

    def __init__(self, weights: GemvWeights, model_arrays: dict[str, np.ndarray], rope: RopeTable, rows: int,
                 pool: AttentionPool | None = None, split: bool = SPLIT_LINEARS):
        """split: the linears' column tiles shared with the pool's helper thread during a step (`SPLIT_LINEARS`)."""
        cfg = weights.cfg
        self.cfg, self.rope, self.rows, self.pool, self.weights = cfg, rope, rows, pool, model_arrays
        self.embed_scale = None if cfg.embed_scale == 1.0 else np.float32(cfg.embed_scale)
        zeros = lambda width: buffers.zeros((rows, width))  # noqa: E731
        self.h = (zeros(cfg.hidden), zeros(cfg.hidden))
        self.a = zeros(cfg.q_dim)
        self.q = buffers.zeros((rows, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim))
        self.qkv, self.o, self.gu = zeros(cfg.q_dim + 2 * cfg.kv_dim), zeros(cfg.hidden), zeros(2 * cfg.ffn)
        # Gemma 3's post-norms (RMSNorm of o and of down before their residual adds) need a whole row of the linear's
        # output, which a column tile's epilogue never has: o and down end the kernels' jobs, the norms and the adds
        # run here between them (`_post_norms`)
        self.post, self.norms = cfg.post_norms, weights.norms
        self.d = zeros(cfg.hidden) if self.post else None
        kmax = max(cfg.hidden, cfg.q_dim, cfg.ffn)
        self.scratch = tuple(gemv.Scratch(rows, kmax) for _ in range(2))
        jobs = []
        on = weights.online
        for layer in range(cfg.n_layers):
            h_in, h_out = self.h[layer % 2], self.h[(layer + 1) % 2]
            lin = lambda site: weights.linears[f"{layer}.{site}"]  # noqa: E731
            bias = lambda site: weights.biases.get(f"{layer}.{site}")  # noqa: E731
            norm = lambda f: weights.norms[f"layers.{layer}.{f}"]  # noqa: E731
            s = self.scratch[0]
            jobs += [
                gemv.bind(lin("attn_in"), h_in, self.qkv, s, norm=norm("attn_norm"), eps=cfg.rms_eps,
                          hadamard=on.get("attn_in", 0), bias=bias("attn_in")),
                gemv.bind(lin("o_in"), self.a, self.o, s, hadamard=on.get("o_in", 0), bias=bias("o_in")),
                gemv.bind(lin("ffn_in"), h_in, self.gu, s, add=self.o, norm=norm("ffn_norm"), eps=cfg.rms_eps,
                          hadamard=on.get("ffn_in", 0), bias=bias("ffn_in")),
                gemv.bind(lin("down_in"), self.gu, self.d if self.post else h_out, s, gated=cfg.act,
                          hadamard=on.get("down_in", 0), bias=bias("down_in"), res=() if self.post else (h_in, self.o)),
            ]
        self.table = _Table.of(jobs, self.scratch if pool is not None and split else None)

    def split(self) -> bool:
        """Whether the step has its two-core form, which costs nothing to build and runs from the first step: its
        attention shared with the helper (and its linears' tiles, when made with split)."""
        return self.pool is not None

    def forward(self, cache: KVCache, tree: TokenTree, slot: int, layers: int | None = None) -> np.ndarray:
        """The hidden states [C, hidden] after `layers` layers (default all) of the tree's rows (padded to C with the
        root) rooted at position `slot`; their K/V go to cache rows slot.. (cache.length unchanged)."""
        from hetero.decode.bound_step import start_rows
        from hetero.decode.rowattn import decode_rows

        cfg = self.cfg
        depth = cfg.n_layers if layers is None else layers
        layout, shared, bases = start_rows(self, cache, tree, slot, depth)
        pool = self.pool if shared else None
        for layer in range(depth):
            self._linears(4 * layer, 4 * layer + 1, pool)
            if cfg.qk_norm:
                qk_norm_(cfg, self.qkv, self.weights[f"layers.{layer}.q_norm"], self.weights[f"layers.{layer}.k_norm"])
            if shared:
                self.pool.attend(cfg, layer, self.qkv, layout, bases[layer])
            else:
                decode_rows(cfg, self.qkv, *cache.layer(layer), layout, self.a, layer, bases[layer])
            if self.post:
                self._post_norms(layer, pool)
            else:
                self._linears(4 * layer + 1, 4 * layer + 4, pool)
        return self.h[depth % 2]

    def _post_norms(self, layer: int, pool: AttentionPool | None) -> None:
        """A layer's o → FFN with post-norms, as `model.o_ffn`: o = norm(o·Wo), h1 = h + o, d = norm(down(FFN(h1))),
        h_out = h1 + d (the sums in the MatMulNBits graph's order, `npu.nbits.layer_graph`)."""
        cfg, norms = self.cfg, self.norms
        h_in, h_out = self.h[layer % 2], self.h[(layer + 1) % 2]
        self._linears(4 * layer + 1, 4 * layer + 2, pool)
        _rms_norm_(self.o, norms[f"layers.{layer}.post_attn_norm"], cfg.rms_eps)
        self._linears(4 * layer + 2, 4 * layer + 4, pool)  # ffn_in reads h_in + o itself (its job's add)
        _rms_norm_(self.d, norms[f"layers.{layer}.post_ffn_norm"], cfg.rms_eps)
        np.add(h_in, self.o, out=h_out)
        h_out += self.d

    def _linears(self, first: int, last: int, pool: AttentionPool | None) -> None:
        """Jobs first..last-1 (a layer's q|k|v, or its o → FFN: jobs 4·layer..4·layer+3)."""
        self.table.run(first, last, pool)


def _rms_norm_(x: np.ndarray, w: np.ndarray, eps: float) -> None:
    """x [rows, n] ← RMSNorm(x)·w in place: `model.rms_norm` through torch views, as `attention.qk_norm_` (a model
    with post-norms has QK-norm too, so a step of it has imported torch already)."""
    import torch

    from hetero.model import rms_norm

    t = torch.from_numpy(x)
    with torch.inference_mode():
        t.copy_(rms_norm(t, torch.from_numpy(w), eps))


class GemvHead:
    """final RMSNorm + the LM head on hetero's GEMV (`native.gemv`: the 8-bit weights MatMulNBits' head reads, int8
    activations per block of 32); with split, its vocabulary tiles shared with the helper thread (`SPLIT_LINEARS`)."""

    name = "gemv"

    def __init__(self, weights: GemvWeights, pool: AttentionPool | None = None, split: bool = SPLIT_LINEARS):
        self.cfg, self.weights, self.pool, self._split = weights.cfg, weights, pool, split
        self._bound: dict[int, tuple[np.ndarray, np.ndarray, _Table]] = {}

    def _bind(self, rows: int) -> tuple[np.ndarray, np.ndarray, _Table]:
        b = self._bound.get(rows)
        if b is None:
            cfg = self.cfg
            x, out = buffers.zeros((rows, cfg.hidden)), buffers.zeros((rows, cfg.vocab))
            scratch = tuple(gemv.Scratch(rows, cfg.hidden) for _ in range(2))
            job = gemv.bind(self.weights.linears["head"], x, out, scratch[0], norm=self.weights.norms["norm"],
                            eps=cfg.rms_eps)
            b = self._bound[rows] = (x, out, _Table.of([job], scratch if self.pool is not None and self._split else None))
        return b

    def __call__(self, h: np.ndarray) -> np.ndarray:
        if np.size(h) == 0:  # a step that only writes K/V (a drafter catching up) asks for no logits
            return buffers.empty((*np.shape(h)[:-1], self.cfg.vocab))
        x = np.asarray(h, np.float32).reshape(-1, self.cfg.hidden)
        buf, out, table = self._bind(x.shape[0])
        buf[...] = x
        table.run(0, 1, self.pool)
        return out.copy().reshape(*np.shape(h)[:-1], -1)
