"""A decode step's linears as hetero's own int8 GEMVs on AVX-512 VNNI (`gemv_vnni.c`).

A plain decode step streams every weight once per token. ONNX Runtime's `MatMulNBits` (8-bit weights in blocks of
128, int8 activations per block: `npu.nbits`) ran the default model's 30 layers' one-row graphs at ~18 GB/s on this
host (AMD EPYC Zen 4), which streams ~30 GB/s from one thread (docs/journal.md, "Issue 24 item 3 (session 15)"). These
kernels compute the same product in the same form, the weights quantized by ONNX Runtime's own kernel to the very bytes
MatMulNBits reads (`npu.nbits.quantize_weight`, called by `decode.gemv_step`), repacked for `vpdpbusd` (64 output
columns a tile, 4 weights along K per column a lane), the activations quantized to int8 per block of 32 at run time
(amax / 127: a quarter of MatMulNBits' activation block, which the memory-bound kernel gets for free and which brings
the decode's perplexity back to the graphs'; with blocks of 128 it was 0.14 points worse, docs/journal.md), and fold the
elementwise work around each linear (RMSNorm, the residual adds, act(gate)·up with SiLU, GELU-tanh or ReLU, the online
block Hadamards of a rotated model, QuaRot) into the same call: one call per linear, no graph, no shadow corrections
(as `npu.nbits`). A job may read the GGUF's own Q4_1 / Q8_0 blocks instead (`pack_blocks`, `decode.gguf_blocks`):
blocks of 32 values, one per activation block, so the same activations and epilogues serve every form.

A job is one linear with that work (`Job`); a part is its column range with its own scratch (`Part`): two threads
can run a job's halves at once (`decode.twocore.attnpool`), each computing the prologue itself, and a column's
result does not depend on the split nor on the other rows of a token tree (exact integer sums, float sums in a
fixed order), so a tree row equals its plain step bit for bit and the split step equals the one-thread step.

Compiled once per host (`build.Kernel`); where the CPU lacks AVX-512 VNNI, there is no compiler, or the model has
what the kernels do not compute, `unavailable` says why and the decode step keeps the MatMulNBits graphs.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np

from hetero import layerspec
from hetero.config import ModelConfig
from hetero.errors import ConfigError
from hetero.native.build import Kernel

TILE, QB, AB = 64, 128, 32  # output columns per tile, values of K per weight / activation scale (as gemv_vnni.c)
FLAGS = ("-O3", "-std=gnu11", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-fPIC", "-shared")
NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
GEMV_VERSION = 1  # what `pack_quantized` writes; in the cached arrays' form: bump when the packed layout changes
BLOCKS_VERSION = 1  # what `pack_blocks` writes (in the GGUF block form's cached arrays)
# the weights' forms a job reads (gemv_vnni.c's FMT_*): this module's 8-bit blocks of 128, the GGUF's Q4_1 and Q8_0
FMTS = {"int8": 0, "q4_1": 1, "q8_0": 2}
# the gate activations a job's prologue computes, act(gate)·up (gemv_vnni.c's ACT_*; `model.activation`'s names)
GATED_ACTS = {"silu": 1, "gelu_tanh": 2, "relu": 3}
GB = 32  # values of K in a GGUF Q4_1 / Q8_0 block
_BLOCK = {"q4_1": (20, 1024 + 4 * TILE), "q8_0": (34, 2048 + 2 * TILE)}  # bytes of a block in the file, of a tile's


def _setup(lib: ctypes.CDLL) -> None:
    lib.hetero_gemv_part.restype = ctypes.c_void_p
    lib.hetero_gemv_part.argtypes = [ctypes.c_void_p] * 3
    lib.hetero_gemv_run.restype = None
    lib.hetero_gemv_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]


KERNEL = Kernel("gemv_vnni.c", FLAGS, NEEDS, "the int8 GEMV kernel", _setup, ("simd_math.h",))


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernels (`build.Kernel.load`), loaded once per process."""
    return KERNEL.load()


def part_fn() -> int:
    """The address of `hetero_gemv_part(job, 0, part)`: what the two-core stage runner calls (`attnpool`)."""
    return ctypes.cast(library().hetero_gemv_part, ctypes.c_void_p).value or 0


def config_unsupported(cfg: ModelConfig) -> str | None:
    """What of `cfg`'s layers the kernels do not compute (None: every layer's linears and the head)."""
    lacks = layerspec.lacks(layerspec.LayerSpec.of(cfg), "decode GEMV step")
    if lacks:
        return lacks
    if cfg.act not in GATED_ACTS:  # (the layer spec's act is one feature; the prologue computes these values of it)
        return f"act={cfg.act!r}"
    if any(d % 4 for d in (cfg.hidden, cfg.q_dim, cfg.ffn)):
        return f"a width not a multiple of 4 (hidden {cfg.hidden}, q {cfg.q_dim}, ffn {cfg.ffn})"
    return None


def unavailable(cfg: ModelConfig, build: bool = True) -> str | None:
    """None when the kernels compute `cfg`'s decode linears on this host, else why not (one line). build=False
    checks the CPU, the compiler and the model only (no build: a runtime's placement at start)."""
    lacks = config_unsupported(cfg)
    if lacks:
        return f"this model has {lacks}"
    if not build:
        from hetero.cpu import cpu_flags
        from hetero.native.build import compiler

        missing = [f for f in NEEDS if f not in cpu_flags()]
        if missing:
            return f"this CPU lacks {', '.join(missing)}"
        return None if compiler() is not None else "no C compiler (gcc or cc, or $CC) to build the kernel with"
    return KERNEL.unavailable(library)


def describe() -> str:
    """The decode form in words (`runtime.DecodePlacement.small_form`)."""
    return ("hetero's int8 GEMVs (AVX-512 VNNI): ONNX Runtime's 8-bit symmetric weights in blocks of 128, int8 "
            "activations per block of 32, no shadow corrections")


@dataclass(frozen=True, slots=True)
class Packed:
    """A linear's weights as the kernel reads them, for K inputs and N outputs: fmt "int8", w [tiles, quads·256] uint8
    (zero point 128), ws [tiles, blocks, TILE] float32; or a GGUF block form ("q4_1", "q8_0": `pack_blocks`), w
    [tiles, K/32 · block bytes] with the scales inside, ws empty."""

    w: np.ndarray
    ws: np.ndarray
    k: int
    n: int
    fmt: str = "int8"


def pack_quantized(packed: np.ndarray, scales: np.ndarray, k: int) -> Packed:
    """MatMulNBits' 8-bit symmetric weights in blocks of 128 (packed [N, blocks, 128] uint8 with zero point 128,
    scales [N, blocks]: what ONNX Runtime's quantizer writes, `npu.nbits.quantize_weight`) of a linear with K inputs
    → the kernel's form (`Packed`): tiles of 64 columns × quads of 4 weights along K."""
    n, blocks = scales.shape
    quads, tiles = -(-k // 4), -(-n // TILE)
    q = np.full((tiles * TILE, quads * 4), 128, np.uint8)  # padding columns: weight 0
    q[:n] = packed.reshape(n, -1)[:, : quads * 4]
    w = np.ascontiguousarray(q.reshape(tiles, TILE, quads, 4).transpose(0, 2, 1, 3)).reshape(tiles, quads * 256)
    s = np.zeros((tiles * TILE, blocks), np.float32)
    s[:n] = scales
    ws = np.ascontiguousarray(s.reshape(tiles, TILE, blocks).transpose(0, 2, 1))
    return Packed(w, ws, k, n)


def packed_shapes(k: int, n: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """The shapes of `Packed.w` and `Packed.ws` for K inputs and N outputs (what `pack_quantized` makes): a file
    of packed weights is laid out before any is computed. Both are tile-major, so the packs of column blocks
    that are multiples of TILE, stacked along axis 0, are the pack of the whole."""
    tiles = -(-n // TILE)
    return (tiles, -(-k // 4) * 256), (tiles, -(-k // QB), TILE)


def pack_blocks(raw: np.ndarray, fmt: str, k: int) -> Packed:
    """A linear's rows [N, K/32 · 20 or 34] of GGUF Q4_1 or Q8_0 blocks (llama.cpp's bytes: fp16 d [, fp16 m], then
    16 bytes of nibbles, value j low and j + 16 high, or 32 int8) → the kernel's form (gemv_vnni.c: tiles of 64
    columns, each a stream of blocks with their scales). The same numbers, rearranged: nothing is rounded."""
    if fmt not in _BLOCK:
        raise ConfigError(f"gemv: no block form {fmt!r} (one of {sorted(_BLOCK)})")
    size, tile_block = _BLOCK[fmt]
    n = raw.shape[0]
    nbk = k // GB
    if k % GB or raw.ndim != 2 or raw.shape[1] != nbk * size or raw.dtype != np.uint8:
        raise ConfigError(f"gemv: {fmt} rows of K = {k} are [N, {k // GB * size}] uint8 (K a multiple of {GB}), "
                          f"got {raw.shape} {raw.dtype}")
    tiles = -(-n // TILE)
    blocks = np.zeros((tiles * TILE, nbk, size), np.uint8)  # padding columns: d = m = 0 (weight 0)
    blocks[:n] = raw.reshape(n, nbk, size)
    blocks = blocks.reshape(tiles, TILE, nbk, size).transpose(0, 2, 1, 3)  # [tile, block, column, bytes]
    out = np.empty((tiles, nbk, tile_block), np.uint8)
    if fmt == "q4_1":
        q = blocks[..., 4:]  # [.., 16]: value j low nibble, j + 16 high
        vals = np.concatenate([q & 15, q >> 4], axis=-1)  # [.., 32] values 0..15 in K order
        g = vals.reshape(tiles, nbk, 4, 16, 4, 2, 4)  # column (u, 16), group of 8 (g), half (h), 4 values (i)
        packed = g[..., 0, :] | (g[..., 1, :] << 4)  # [tile, block, u, col, g, i]
        out[..., :1024] = packed.transpose(0, 1, 4, 2, 3, 5).reshape(tiles, nbk, 1024)  # [g][u][col][i]
        out[..., 1024:] = blocks[..., :4].reshape(tiles, nbk, TILE, 2, 2).transpose(0, 1, 3, 2, 4).reshape(
            tiles, nbk, 4 * TILE)  # d [64] fp16, then m [64]
    else:
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # zero point 128
        out[..., :2048] = q.reshape(tiles, nbk, TILE, 8, 4).transpose(0, 1, 3, 2, 4).reshape(tiles, nbk, 2048)
        out[..., 2048:] = blocks[..., :2].reshape(tiles, nbk, 2 * TILE)
    return Packed(out.reshape(tiles, nbk * tile_block), np.zeros(0, np.float32), k, n, fmt)


def dequantized(p: Packed) -> np.ndarray:
    """The float weight [K, N] a packed linear computes with (tests, references)."""
    if p.fmt != "int8":
        return _blocks_dequantized(p)
    tiles = p.w.shape[0]
    quads = p.w.shape[1] // 256
    q = p.w.reshape(tiles, quads, TILE, 4).transpose(0, 2, 1, 3).reshape(tiles * TILE, quads * 4)
    blocks = p.ws.shape[1]
    s = p.ws.transpose(0, 2, 1).reshape(tiles * TILE, blocks)
    wq = (q.astype(np.float32) - 128.0)[:, : p.k]
    return (wq * np.repeat(s, QB, axis=1)[:, : p.k])[: p.n].T.copy()


def _blocks_dequantized(p: Packed) -> np.ndarray:
    """`dequantized` of a GGUF block form: d·q + m (Q4_1) or d·q (Q8_0) in float32, as llama.cpp's dequantization."""
    tiles, nbk = p.w.shape[0], p.k // GB
    blk = p.w.reshape(tiles, nbk, -1)
    if p.fmt == "q4_1":
        b = blk[..., :1024].reshape(tiles, nbk, 4, 4, 16, 4)  # [tile, block, g, u, col, i]
        q = np.stack([b & 15, b >> 4], axis=-2)  # [.., g, u, col, half, i]
        q = q.transpose(0, 3, 4, 1, 2, 5, 6).reshape(tiles * TILE, p.k)  # column-major over K: block, g, half, i
        dm = blk[..., 1024:].copy().view(np.float16).astype(np.float32).reshape(tiles, nbk, 2, TILE)
        d = dm[:, :, 0].transpose(0, 2, 1).reshape(tiles * TILE, nbk)
        m = dm[:, :, 1].transpose(0, 2, 1).reshape(tiles * TILE, nbk)
        w = q.reshape(-1, nbk, GB) * d[..., None] + m[..., None]
    else:
        q = blk[..., :2048].reshape(tiles, nbk, 8, TILE, 4).transpose(0, 3, 1, 2, 4).reshape(tiles * TILE, p.k)
        d = blk[..., 2048:].copy().view(np.float16).astype(np.float32).reshape(tiles, nbk, TILE)
        d = d.transpose(0, 2, 1).reshape(tiles * TILE, nbk)
        w = (q.astype(np.float32) - 128.0).reshape(-1, nbk, GB) * d[..., None]
    return np.ascontiguousarray(w.reshape(tiles * TILE, p.k)[: p.n].T.astype(np.float32))


_P, _I = ctypes.c_void_p, ctypes.c_int64


class Job(ctypes.Structure):
    """One linear with its prologue and epilogue (gemv_vnni.c's `Job`)."""

    _fields_ = [("rows", _I), ("in0", _P), ("in1", _P), ("ld_in", _I), ("norm", _P), ("eps", ctypes.c_double),
                ("act", _I), ("had", _I), ("k", _I), ("n", _I), ("w", _P), ("ws", _P), ("bias", _P), ("res0", _P),
                ("res1", _P), ("out", _P), ("ld_out", _I), ("fmt", _I)]


class Part(ctypes.Structure):
    """A job's column range and its scratch (gemv_vnni.c's `Part`)."""

    _fields_ = [("lo", _I), ("hi", _I), ("next", _P), ("xs", _P), ("xq", _P), ("sa", _P), ("xsum", _P)]


def _addr(a: np.ndarray | None, what: str, dtype=np.float32) -> int | None:
    if a is None:
        return None
    if a.dtype != dtype or not a.flags.c_contiguous:
        raise ConfigError(f"gemv: {what} must be C-contiguous {np.dtype(dtype).name}, got {a.dtype}")
    return a.ctypes.data


class Scratch:
    """A part's scratch for jobs of up to `rows` rows and K up to `k` (x, its int8 form, block scales and sums)."""

    def __init__(self, rows: int, k: int):
        blocks = -(-k // QB)
        self.rows, self.k = rows, k
        self.xs = np.zeros(rows * k, np.float32)
        self.xq = np.zeros(rows * blocks * QB + 64, np.int8)
        self.sa = np.zeros(rows * blocks * (QB // AB), np.float32)
        self.xsum = np.zeros(rows * blocks * (QB // AB), np.int32)

    def part(self, lo: int, hi: int, counter: int | None = None) -> Part:
        """Columns lo..hi on this scratch (multiples of TILE); counter: the address of an int64 the job's parts claim
        tiles from (zero before each run), or None for the fixed range."""
        part = Part(lo, hi, counter, self.xs.ctypes.data, self.xq.ctypes.data, self.sa.ctypes.data,
                    self.xsum.ctypes.data)
        part.scratch = self  # the arrays it points at live as long as the part
        return part


@dataclass
class Bound:
    """A job bound to fixed buffers: the struct, its whole-width part and (once `halves` is asked) two halves; keeps
    every array the struct points at alive."""

    job: Job
    whole: Part
    keep: tuple
    rows: int
    n: int

    @property
    def tiles(self) -> int:
        return -(-self.n // TILE)

    def halves(self, a: Scratch, b: Scratch, counter: int) -> tuple[Part, Part]:
        """Two parts on two scratches (the main thread's and the helper's) that share the job's tiles through the
        int64 at address `counter` (zero before each run): each claims the next tile until none is left."""
        return a.part(0, self.tiles * TILE, counter), b.part(0, self.tiles * TILE, counter)


def bind(p: Packed, x: np.ndarray, out: np.ndarray, scratch: Scratch, *, add: np.ndarray | None = None,
         norm: np.ndarray | None = None, eps: float = 0.0, gated: str | None = None, hadamard: int = 0,
         bias: np.ndarray | None = None, res: tuple[np.ndarray, ...] = ()) -> Bound:
    """One job over fixed buffers: out[:, :N] = [res0 (+ res1) +] (x' · W [+ bias]) with x' = x [+ add], RMSNorm'd
    by `norm` (eps), or act(x[:, :K])·x[:, K:2K] (gated: the act, of `GATED_ACTS`), then x'·T (block Hadamard of size
    `hadamard`); the activation rows quantized per block of 32 (module docstring). Every buffer [rows, ·] float32,
    C-contiguous."""
    rows = x.shape[0]
    if gated is not None and gated not in GATED_ACTS:
        raise ConfigError(f"gemv: gated must be one of {sorted(GATED_ACTS)} or None, got {gated!r}")
    width = 2 * p.k if gated else p.k
    if x.ndim != 2 or x.shape[1] < width or out.shape[0] != rows or out.shape[1] < p.n:
        raise ConfigError(f"gemv: x {x.shape} and out {out.shape} must be [rows, >= {width}] and [rows, >= {p.n}]")
    if add is not None and add.shape != x.shape:
        raise ConfigError(f"gemv: add {add.shape} must be x's shape {x.shape}")
    if gated and (add is not None or norm is not None):
        raise ConfigError("gemv: a gated job takes x alone (no add, no norm)")
    if any(r.shape != out.shape for r in res) or len(res) > 2:
        raise ConfigError(f"gemv: at most two residuals of out's shape {out.shape}")
    if (norm is not None and norm.shape != (p.k,)) or (bias is not None and bias.shape != (p.n,)):
        raise ConfigError(f"gemv: norm must be [{p.k}] and bias [{p.n}]")
    if hadamard and (hadamard & (hadamard - 1) or p.k % hadamard):
        raise ConfigError(f"gemv: a Hadamard of {hadamard} (a power of two dividing {p.k})")
    if scratch.rows < rows or scratch.k < p.k:
        raise ConfigError(f"gemv: scratch for {scratch.rows} rows of {scratch.k} is too small ({rows} of {p.k})")
    w = np.ascontiguousarray(p.w)
    ws = np.ascontiguousarray(p.ws, np.float32)
    norm = None if norm is None else np.ascontiguousarray(norm, np.float32)
    bias = None if bias is None else np.ascontiguousarray(bias, np.float32)
    job = Job(rows, _addr(x, "x"), _addr(add, "add"), x.shape[1], _addr(norm, "norm"), float(eps),
              GATED_ACTS.get(gated, 0), int(hadamard), p.k, p.n, _addr(w, "w", np.uint8), _addr(ws, "ws"),
              _addr(bias, "bias"), _addr(res[0] if res else None, "res0"),
              _addr(res[1] if len(res) > 1 else None, "res1"),
              _addr(out, "out"), out.shape[1], FMTS[p.fmt])
    b = Bound(job, scratch.part(0, -(-p.n // TILE) * TILE), (x, add, norm, w, ws, bias, res, out, scratch), rows, p.n)
    return b


def run(b: Bound) -> None:
    """One job on this thread, whole."""
    library().hetero_gemv_part(ctypes.addressof(b.job), None, ctypes.addressof(b.whole))
