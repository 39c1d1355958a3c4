"""One declarative layer spec per architecture, and what each writing of the layer's math computes of it.

hetero writes the decoder layer's math more than once, for speed: the torch reference, the ONNX export of its
linears, the prefill attention (GroupQueryAttention, or hetero's BF16 kernel), the decode attention, the decode
steps and their GEMVs, the MatMulNBits graphs, the native glue ops, the rotation of the weights. `LayerSpec` declares
one architecture's layer as fields whose defaults are the plain Llama block (pre-RMSNorms, no biases, SiLU-gated FFN,
full RoPE of base 10000, causal attention over every key, one KV head per query head); `LayerSpec.features` names the
fields that differ, found from the dataclass's fields, so a field added later is seen with no other edit.

Each writing is registered here (`register`) with the parts of the layer it writes and the features it computes
there; `refusal` names the first feature of a spec that a composition of writings does not compute, so what a method
refuses is derived from the registrations, never listed by hand. A field with no part (one added without deciding
where it acts) belongs to every part: every writing refuses it until its registration says it computes it.

The registrations sit in this one module, not in the writings' own: a runtime asks them at its start, before it
imports any writing (the torch reference imports torch, 2.5 s; the ONNX export onnx, 1.6 s), and core cannot import
the techniques layer. Each names its module and the tests that hold it equal to the reference on tiny models with
those features (their table: docs/design.md, "The layer").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# The parts of a layer a writing may write: the embedding's scale; the dense block (norms, linears, biases,
# activation, residual adds); QK-norm, between the q/k projection and RoPE; RoPE; the attention proper.
PARTS = ("embed", "dense", "qk", "rope", "attention")


def _feature(default: Any, part: str) -> Any:
    return field(default=default, metadata={"part": part})


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One architecture's decoder layer, each field at its plain Llama block default unless the model differs."""

    embed_scale: float = _feature(1.0, "embed")  # the embedding times this (Gemma 3: sqrt(hidden) in float32)
    qkv_bias: bool = _feature(False, "dense")  # biases on q/k/v (Qwen2, `attention_bias`)
    o_bias: bool = _feature(False, "dense")  # a bias on o_proj
    mlp_bias: bool = _feature(False, "dense")  # biases on gate/up/down
    act: str = _feature("silu", "dense")  # the gate's activation
    post_norms: bool = _feature(False, "dense")  # RMSNorm of the attention and FFN outputs before their adds (Gemma 3)
    qk_norm: bool = _feature(False, "qk")  # RMSNorm of each q/k head before RoPE (Qwen3, Gemma 3)
    rope_type: str = _feature("default", "rope")  # RoPE scaling: linear, llama3, freqs, longrope
    rope_theta: float = _feature(10000.0, "rope")  # RoPE base
    local_rope_theta: float = _feature(0.0, "rope")  # the windowed layers' own RoPE base (Gemma 3)
    rotary_dim: int = _feature(0, "rope")  # dims of a head RoPE rotates, when not all (Phi partial rotary); 0: all
    windows: tuple[int, ...] = _feature((), "attention")  # per layer sliding window (0: full), when any layer has one
    attn_scale: float = _feature(0.0, "attention")  # softmax scale, when not head_dim ** -0.5 (Gemma 3)
    head_dim: int = _feature(0, "attention")  # a head size other than hidden / n_heads (Gemma 3, Qwen3); 0: that
    kv_group: int = _feature(1, "attention")  # query heads per KV head (GQA)

    @classmethod
    def of(cls, cfg: Any) -> "LayerSpec":
        """The spec of a `config.ModelConfig` (read by attribute: this module imports no other of hetero's)."""
        return cls(
            embed_scale=cfg.embed_scale, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, mlp_bias=cfg.mlp_bias, act=cfg.act,
            post_norms=cfg.post_norms, qk_norm=cfg.qk_norm, rope_type=cfg.rope_scaling.get("rope_type", "default"),
            rope_theta=cfg.rope_theta, local_rope_theta=cfg.local_rope_theta,
            rotary_dim=0 if cfg.rotary_dim == cfg.head_dim else cfg.rotary_dim,
            windows=tuple(cfg.windows) if any(cfg.windows) else (), attn_scale=cfg.attn_scale,
            head_dim=0 if cfg.head_dim * cfg.n_heads == cfg.hidden else cfg.head_dim,
            kv_group=cfg.n_heads // cfg.n_kv_heads)

    def features(self) -> dict[str, Any]:
        """The fields that differ from the plain block (name -> value), in field order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}

    def part(self, name: str) -> str | None:
        """The part of the layer feature `name` acts in; None: not declared (a field added without one)."""
        return next(f.metadata.get("part") for f in dataclasses.fields(self) if f.name == name)


@dataclass(frozen=True, slots=True)
class Writing:
    """One writing of (a part of) the layer's math: where it is, what it writes, what it computes there."""

    name: str
    module: str  # where it is written (the test_docs check: it exists)
    parts: frozenset[str]  # the parts of the layer it writes (`PARTS`)
    computes: frozenset[str]  # the features (`LayerSpec` fields) it computes in those parts
    tests: tuple[str, ...]  # the tests that hold it equal to the reference on tiny models with those features

    def computes_feature(self, spec: LayerSpec, name: str) -> bool:
        """Whether a layer with feature `name` of `spec` is right through this writing: it computes it, or the feature
        acts in a part this writing does not write."""
        part = spec.part(name)
        return name in self.computes or (part is not None and part not in self.parts)

    def lacks(self, spec: LayerSpec) -> str | None:
        """'name=value' of the first feature of `spec` this writing does not compute, or None."""
        return next((f"{k}={v!r}" for k, v in spec.features().items() if not self.computes_feature(spec, k)), None)


WRITINGS: dict[str, Writing] = {}


def register(name: str, module: str, parts: Iterable[str], computes: Iterable[str], *tests: str) -> Writing:
    """Record what writing `name` computes; a part or feature the spec does not have is a mistake here, refused."""
    w = Writing(name, module, frozenset(parts), frozenset(computes), tests)
    spec, names = LayerSpec(), {f.name for f in dataclasses.fields(LayerSpec)}
    bad = [p for p in w.parts if p not in PARTS] + [c for c in w.computes if c not in names]
    if bad or name in WRITINGS or not tests:
        why = "already registered" if name in WRITINGS else f"unknown {bad}" if bad else "no test holds it"
        raise ValueError(f"writing {name!r}: {why}")
    outside = sorted(c for c in w.computes if spec.part(c) not in w.parts)
    if outside:
        raise ValueError(f"writing {name!r} registers {outside} outside its parts {sorted(w.parts)}")
    WRITINGS[name] = w
    return w


def refusal(spec: LayerSpec, writings: Iterable[str]) -> str | None:
    """'name=value (not in: writing, ...)' of the first feature of `spec` that one of `writings` does not compute (the
    message names every such writing), or None: the composition computes this layer."""
    ws = [writing(n) for n in writings]
    for name, value in spec.features().items():
        missing = [w.name for w in ws if not w.computes_feature(spec, name)]
        if missing:
            return f"{name}={value!r} (not in: {', '.join(missing)})"
    return None


def writing(name: str) -> Writing:
    """The registered writing `name` (a name no writing has is a mistake of its caller: ValueError)."""
    if name not in WRITINGS:
        raise ValueError(f"no writing of the layer is registered as {name!r}: {sorted(WRITINGS)}")
    return WRITINGS[name]


def lacks(spec: LayerSpec, name: str) -> str | None:
    """'name=value' of the first feature of `spec` writing `name` does not compute (None: it computes this layer), for
    a fast path that runs only where it computes the model's layer (the BF16 kernel, the GEMVs, the glue ops)."""
    return writing(name).lacks(spec)


_ROPE = ("rope_type", "rope_theta", "local_rope_theta", "rotary_dim")
_ATTENTION = ("windows", "attn_scale", "head_dim", "kv_group")
_DENSE = ("qkv_bias", "o_bias", "mlp_bias", "act", "post_norms")

register("torch reference", "hetero.model", PARTS, ("embed_scale", *_DENSE, "qk_norm", *_ROPE, *_ATTENTION),
         "tests/test_architectures.py::test_float_logits_match_transformers")
register("prefill embedding", "hetero.runtime", ("embed",), ("embed_scale",),
         "tests/test_architectures.py::test_float_logits_match_transformers")
register("ONNX export", "hetero.npu.export", ("dense",), _DENSE,
         "tests/test_architectures.py::test_int8_path_computes_the_variant",
         "tests/test_architectures.py::test_gemma3_on_the_int8_path")
# ChunkAttention: the GroupQueryAttention node, QK-norm and a local RoPE table beside it, `model.attention` for
# rotary widths the node does not take
register("prefill attention", "hetero.attention", ("qk", "rope", "attention"), ("qk_norm", *_ROPE, *_ATTENTION),
         "tests/test_architectures.py::test_float_logits_match_transformers",
         "tests/test_attention.py::test_chunks_equal_reference_attention_and_write_only_real_rows")
# the node alone, inside a whole-layer graph: nothing between the qkv linears and it, one RoPE table
register("GroupQueryAttention node", "hetero.attention", ("qk", "rope", "attention"),
         ("rope_type", "rope_theta", "rotary_dim", *_ATTENTION),
         "tests/test_architectures.py::test_float_logits_match_transformers",
         "tests/npu/test_fused_layer.py::test_fused_layers_equal_the_segments")
# QK-norm and partial rotary in the kernel; the layer's RoPE table (a windowed layer's local base) from its caller
register("BF16 attention kernel", "hetero.native.attention", ("qk", "rope", "attention"), ("qk_norm", *_ROPE, *_ATTENTION),
         "tests/test_native_attention.py::test_chunked_attention_matches_fp64",
         "tests/test_architectures.py::test_gemma3_on_the_fast_prefill_path",
         "tests/test_architectures.py::test_partial_rotary_on_the_int8_path")
# the export keeps ONNX Runtime's nodes where a bias sits, for an activation other than SiLU (`ort_ops.SILU_HADAMARD_QUANT`)
# and around a post-norm, the ops then quantizing a rotated site's input alone (`ort_ops.HADAMARD_QUANT`)
register("native glue ops", "hetero.native.ort_ops", ("dense",), ("qkv_bias", "o_bias", "mlp_bias", "act", "post_norms"),
         "tests/test_layerspec.py::test_the_glue_ops_compute_the_biases_they_register",
         "tests/test_layerspec.py::test_the_glue_ops_compute_gemma3s_layer")
# the INT8 decode step binds the export's graphs and the decode attention; its own: the embedding, QK-norm
register("INT8 decode step", "hetero.decode.bound_step", ("embed", "qk"), ("embed_scale", "qk_norm"),
         "tests/test_architectures.py::test_int8_path_computes_the_variant",
         "tests/test_architectures.py::test_gemma3_on_the_int8_path")
register("decode attention", "hetero.decode.rowattn", ("rope", "attention"), (*_ROPE, *_ATTENTION),
         "tests/decode/test_rowattn.py::test_decode_rows_equal_one_row_steps_over_their_paths",
         "tests/test_architectures.py::test_partial_rotary_on_the_int8_path")
# the GEMV kernels fuse the gate's activation (SiLU, GELU-tanh, ReLU: `gemv.GATED_ACTS`) and the residual adds; Gemma's
# post-norms run between the kernels' jobs (`gemv_step.GemvStep._post_norms`)
register("decode GEMV step", "hetero.decode.gemv_step", ("embed", "dense", "qk"),
         ("embed_scale", "qkv_bias", "o_bias", "mlp_bias", "act", "post_norms", "qk_norm"),
         "tests/test_layerspec.py::test_the_gemv_step_computes_the_features_it_registers")
# the same step over the file's own blocks, in the model's space (its embedding, norms, biases)
register("decode GGUF blocks", "hetero.decode.gguf_blocks", ("embed", "dense", "qk"), ("qkv_bias", "qk_norm"),
         "tests/decode/test_gguf_blocks.py::test_the_block_kernels_equal_the_files_dequantized_weights",
         "tests/decode/test_gguf_blocks.py::test_a_step_beside_a_rotated_prefill_equals_the_files_float_model")
register("nbits", "hetero.npu.nbits", ("dense",), _DENSE,
         "tests/test_layerspec.py::test_nbits_graphs_compute_the_dense_features_they_register")
register("rotation", "hetero.outliers.rotate", ("embed", "dense", "qk"), ("embed_scale", *_DENSE, "qk_norm"),
         "tests/outliers/test_rotate.py::test_rotated_tiny_model_equals_float",
         "tests/test_architectures.py::test_gemma3_on_the_int8_path")

# What each kind of method runs (`methods.Method.writings`): a float method the reference and the decode attention;
# an INT8 one the export's graphs, the prefill attention on the CPU, the bound decode step and the MatMulNBits graphs
# where the GEMVs do not run (the fast paths, where they lack a feature, give way: `lacks`), and a rotating recipe the
# rotation.
FLOAT = ("prefill embedding", "torch reference", "decode attention")
INT8 = ("prefill embedding", "ONNX export", "prefill attention", "INT8 decode step", "decode attention", "nbits")
ROTATION = "rotation"
