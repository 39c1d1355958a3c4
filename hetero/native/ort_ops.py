"""hetero's own ONNX Runtime CPU ops (`hetero/native/ort_ops.c`, domain "ai.hetero"), for the layer graphs' float glue.

mllm-NPU §3.2 keeps the float ops between a layer's INT8 matmuls in the graph where the NPU can run them, and on
the CPU where it cannot. On a host whose "NPU" is the CPU EP itself those ops are ONNX Runtime nodes, and at the
row counts of a prefill chunk (32–256) a node costs more than its arithmetic: down_in's input (SiLU·up, the rotated
model's online 64-block Hadamard, a scale per row, the u8 quantization) was 12 nodes and a quarter of an o→FFN
graph's time, the Hadamard alone a [T·F/64, 64] × [64, 64] float matmul (docs/journal.md, "Issue 24 (session 17)").
Three ops compute an o→FFN graph's float glue in one pass over each row each: `SiluHadamardQuant` (down_in's input, the
Hadamard as a fast Walsh–Hadamard transform), `AddRmsNormQuant` (the residual, RMSNorm and ffn_in's quantization) and
`ScaleAdd` (down's rows at their scales plus the residual); a fourth, `RmsNormQuant`, is the q|k|v graph's RMSNorm and
quantization; `HadamardQuant`, `HadamardQuant16` and `HadamardRowQuant` a rotated site's online Hadamard and quantization (8 bits,
W8A16's two bytes, or 8 bits with a scale per row) where no fused op computes its input (another activation, a post-norm: Gemma 3). The INT8 GEMMs
stay ONNX Runtime's.

The library is compiled once per host (`build.Kernel`: AVX-512, the host's C compiler, a content-checked cache) and
registered in every CPU EP session hetero makes of its graphs (`sessions.session_options`), so a cached graph that
holds the op loads like any other. Where it cannot be built (no AVX-512, no compiler) `unavailable` says why and the
graph builder keeps the ONNX nodes (`graph_backend.NpuBackend`: only graphs whose spec names the op use it, and the
spec is in their cache key).
"""

from __future__ import annotations

import ctypes
import functools

from hetero.errors import ConfigError
from hetero.native.build import Kernel

DOMAIN = "ai.hetero"
SILU_HADAMARD_QUANT = "SiluHadamardQuant"  # down_in's input: SiLU·up, the online Hadamard, u8 quantization
ADD_RMS_NORM_QUANT = "AddRmsNormQuant"  # the residual after attention and ffn_in's u8 input at a static scale
RMS_NORM_QUANT = "RmsNormQuant"  # attn_in's u8 input at a static scale (the q|k|v graph)
SCALE_ADD = "ScaleAdd"  # a per-row site's product at its rows' scales plus the residual
HADAMARD_QUANT = "HadamardQuant"  # a rotated site's input: the online Hadamard, u8 quantization at a static scale
HADAMARD_QUANT16 = "HadamardQuant16"  # the same to W8A16's two bytes of the int16 grid (`npu.site_ops.a16_bytes`)
HADAMARD_ROW_QUANT = "HadamardRowQuant"  # the same with a scale per row (`outliers.rowscale`), as SiluHadamardQuant's
BLOCK = 64  # the online Hadamard's block the op computes (`rotate.ONLINE_BLOCK`)
FLAGS = ("-O3", "-std=gnu11", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-fno-math-errno",
         "-fPIC", "-shared", "-pthread")
NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
KERNEL = Kernel("ort_ops.c", FLAGS, NEEDS, "hetero's ONNX Runtime ops", lambda lib: None, ("simd_math.h",))


@functools.cache
def _library() -> tuple[ctypes.CDLL, str]:
    """The compiled library and its file, loaded once and kept: ONNX Runtime's sessions call into it (a session that
    registers it opens it again; this handle keeps it mapped for the process's life)."""
    return KERNEL.load_with_path()


def unavailable() -> str | None:
    """None when the ops run on this host (building the library once), else why not (one line)."""
    return KERNEL.unavailable(_library)


def library_path() -> str:
    """The library's file for `SessionOptions.register_custom_ops_library`; ConfigError where it cannot run here."""
    why = unavailable()
    if why is not None:
        raise ConfigError(f"hetero's own ONNX Runtime ops cannot run here: {why}")
    return _library()[1]


def key() -> str:
    """What the ops compute, for the cache keys of graphs that hold them (the source and flags)."""
    return KERNEL.key()
