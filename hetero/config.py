"""Model configuration of the decoder families hetero runs, read from GGUF or HF, and checked.

One layer (`hetero.model`) computes every architecture; a variant is a field here (biases, activation,
per-layer sliding windows, QK-norm, Gemma 3's post-norms, scaled embedding and query scale, local RoPE
base, partial rotary). The rule: a config either maps onto these fields exactly, so that hetero computes
what transformers computes for it, or it is refused in one line naming the field and its value
(`from_hf` here; GGUF keys in `hetero.loader`). `quantized_unsupported` names what the INT8 path
(graphs, rotation, decode's bound step) does not implement yet, from what each writing of the layer registers
(`hetero.layerspec`).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from hetero import layerspec
from hetero.errors import ConfigError, ModelFormatError

# Architectures whose decoder layer is the Llama block (RMSNorm, RoPE, GQA attention, gated FFN) or a
# config-driven variant of it: Qwen2 (q/k/v biases), Qwen3 (QK-norm), Gemma 3 (see the module doc), Phi-3
# (fused qkv/gate_up, split at load; partial rotary).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                  "gemma3_text": "gemma3", "phi3": "phi3"}
# freqs: GGUF's rope_freqs divisors (Llama 3.x); longrope: Phi-3's, in its short regime (`longrope`)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freqs", "longrope")
# transformers' hidden_act names -> the activation `model.activation` computes (gelu_new is the tanh form)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "relu": "relu"}
_ROPE_KEYS = {"default": set(), "linear": {"factor"},
              "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
              "longrope": {"short_factor", "long_factor", "original_max_position_embeddings"}}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes, constants and variant fields of one decoder-only model (defaults: the plain Llama block)."""

    arch: str  # one of SUPPORTED_ARCHITECTURES
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    context_length: int
    rms_eps: float
    rope_theta: float
    head_dim: int = 0  # 0: hidden // n_heads
    qkv_bias: bool = False  # biases on q/k/v (Qwen2; Llama/Qwen3/Gemma 3 `attention_bias`)
    tie_embeddings: bool = True
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # {"rope_type": ..., "factor": ...}
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    o_bias: bool = False  # a bias on o_proj (Llama/Qwen3/Gemma 3 `attention_bias`)
    mlp_bias: bool = False  # biases on gate/up/down (Llama `mlp_bias`)
    act: str = "silu"  # the gate's activation: silu, gelu, gelu_tanh, relu
    windows: tuple[int, ...] = ()  # per layer: sliding window (keys a query sees, itself included); 0: full
    qk_norm: bool = False  # RMSNorm of each q/k head before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # RMSNorm of the attention and FFN outputs before their residual adds (Gemma 3)
    embed_scale: float = 1.0  # the embedding is multiplied by this (Gemma 3: sqrt(hidden), in float32)
    attn_scale: float = 0.0  # softmax scale of q·k; 0: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    local_rope_theta: float = 0.0  # RoPE base of the windowed layers, unscaled (Gemma 3); 0: as every layer
    rotary_dim: int = 0  # leading dims of a head that RoPE rotates (Phi `partial_rotary_factor`); 0: head_dim

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ModelFormatError(
                f"unsupported architecture {self.arch!r}: hetero supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn", "vocab", "context_length"):
            if getattr(self, name) <= 0:
                raise ModelFormatError(f"model config field {name} must be > 0, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ModelFormatError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelFormatError(f"unsupported rope scaling {rope_type!r}: hetero supports {SUPPORTED_ROPE_TYPES}")
        if self.act not in set(ACTIVATIONS.values()):
            raise ModelFormatError(f"unsupported activation {self.act!r}: hetero computes "
                                   f"{sorted(set(ACTIVATIONS.values()))}")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ModelFormatError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        windows = tuple(int(w) for w in self.windows) or (0,) * self.n_layers
        if len(windows) != self.n_layers or min(windows) < 0:
            raise ModelFormatError(f"windows must hold one window >= 0 per layer ({self.n_layers}), got {self.windows}")
        # a window no shorter than the context never hides a key: plain causal attention
        object.__setattr__(self, "windows", tuple(0 if w >= self.context_length else w for w in windows))

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        """The softmax scale of q·k."""
        return self.attn_scale or self.head_dim**-0.5

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (keys a query sees, itself included); 0: every earlier key."""
        return self.windows[layer]

    def local_rope(self, layer: int) -> bool:
        """Whether `layer` uses the local RoPE table (Gemma 3's windowed layers)."""
        return self.local_rope_theta > 0 and self.windows[layer] > 0

    def variants(self) -> dict[str, Any]:
        """The variant fields that differ from the plain Llama block (name -> value), for messages and `to_hf` (what a
        method refuses: `layerspec.LayerSpec.features`)."""
        plain = {"o_bias": False, "mlp_bias": False, "act": "silu", "qk_norm": False, "post_norms": False,
                 "embed_scale": 1.0, "attn_scale": 0.0, "local_rope_theta": 0.0}
        out = {k: getattr(self, k) for k, v in plain.items() if getattr(self, k) != v}
        if any(self.windows):
            out["windows"] = self.windows
        if self.rotary_dim != self.head_dim:
            out["rotary_dim"] = self.rotary_dim
        return out

    def quantized_unsupported(self) -> str | None:
        """'field=value (not in: writing, ...)' of the first feature of this model's layer that the INT8 path (its
        writings of the layer, rotation included: `layerspec.INT8`) does not compute, or None: such a model runs the
        float methods only (`layerspec.refusal`)."""
        return layerspec.refusal(layerspec.LayerSpec.of(self), (*layerspec.INT8, layerspec.ROTATION))

    def check_quantizable(self, what: str = "the INT8 path") -> None:
        """ConfigError naming the variant, unless the INT8 path computes this model."""
        bad = self.quantized_unsupported()
        if bad is not None:
            raise ConfigError(f"{what} (INT8 graphs, rotation, INT8 decode) does not implement {bad} of this "
                              f"{self.arch} model yet: run it with --method float")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """From `to_dict`'s dict; one without every field was written by a reader that may have dropped a
        variant (an older reader did not read a GGUF's o/FFN biases): refused, so a cache entry is rebuilt."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise ModelFormatError(f"a model config without the fields {missing} (written by an older hetero)")
        return cls(**{k: d[k] for k in names})

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face `config.json` dict, read through transformers' own config class (so every
        default is the architecture's own), every field its modeling code reads checked (`_hf_fields`)."""
        model_type = hf.get("model_type", "")
        arch = HF_MODEL_TYPES.get(model_type)
        if arch is None:
            raise ModelFormatError(f"unsupported architecture {model_type!r} (config.json model_type): hetero "
                                   f"supports {', '.join(HF_MODEL_TYPES)}")
        try:
            from transformers import AutoConfig
            from transformers.utils import logging as hf_logging

            level = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # its validation warnings are not ours to print: we check, or refuse
            try:
                c = AutoConfig.for_model(model_type, **{k: v for k, v in hf.items() if k != "model_type"})
            finally:
                hf_logging.set_verbosity(level)
        except Exception as e:  # transformers validates the config: its message names the field
            raise ModelFormatError(f"config.json is not a valid {model_type} config: {type(e).__name__}: {e}") from e
        try:
            return cls(**_hf_fields(arch, c))
        except (KeyError, AttributeError, TypeError) as e:
            raise ModelFormatError(f"config.json lacks or mistypes a field: {e}") from e

    def to_hf(self) -> dict[str, Any]:
        """As a Hugging Face config dict (for the decoding adapter); plain Llama-block models only."""
        if self.arch not in ("llama", "mistral", "qwen2") or self.variants():
            raise ModelFormatError(f"to_hf: a {self.arch} config with {self.variants()} has no adapter here")
        d: dict[str, Any] = {
            "model_type": self.arch,
            "num_hidden_layers": self.n_layers,
            "hidden_size": self.hidden,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.context_length,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.rope_scaling and self.rope_scaling.get("rope_type", "default") != "default":
            d["rope_scaling"] = dict(self.rope_scaling)
        if self.arch == "llama":
            d["attention_bias"] = self.qkv_bias
        if self.arch == "mistral":
            d["sliding_window"] = None
        return d


def _refuse(name: str, value: Any, why: str) -> ModelFormatError:
    return ModelFormatError(f"config.json field {name}={value!r} is not supported: {why}")


def _rope(name: str, params: dict[str, Any], arch: str) -> tuple[float, dict[str, Any], int | None]:
    """(theta, scaling dict, partial_rotary_factor or None) of one rope_parameters dict, checked."""
    p = dict(params or {})
    nested = [k for k, v in p.items() if isinstance(v, dict)]
    if nested:  # per-layer-type parameters: only Gemma 3 reads them (its caller passes each set here)
        raise _refuse(f"{name}.{nested[0]}", p[nested[0]], f"{arch} reads one set of RoPE parameters for every layer")
    kind = p.get("rope_type", "default")
    if kind not in _ROPE_KEYS:
        raise _refuse(f"{name}.rope_type", kind, f"hetero implements {', '.join(_ROPE_KEYS)} RoPE")
    theta = float(p.get("rope_theta", 10000.0))
    partial = p.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0 and arch != "phi3":
        raise _refuse(f"{name}.partial_rotary_factor", partial, f"{arch} rotates whole heads")
    try:  # keys of other rope types (beta_fast, ...) are not read for this one, by transformers either
        scaling = {k: p[k] for k in _ROPE_KEYS[kind]}
        if kind == "longrope":  # also read: factor, attention_factor (`longrope`)
            scaling.update({k: p[k] for k in ("factor", "attention_factor") if p.get(k) is not None})
    except KeyError as e:
        raise _refuse(f"{name}", p, f"{kind} RoPE needs {e.args[0]}") from e
    if kind != "default":
        scaling["rope_type"] = kind
    return theta, scaling, partial


def _hf_fields(arch: str, c: Any) -> dict[str, Any]:
    """ModelConfig fields of a resolved transformers config of `arch`, refusing what the layer does not compute.

    Each check mirrors what transformers' modeling file of the architecture reads from its config; fields it
    does not read (e.g. Llama's `sliding_window`) change nothing there and are not read here either."""
    if getattr(c, "quantization_config", None):
        raise _refuse("quantization_config", c.quantization_config, "hetero loads float/bf16 checkpoints")
    n_layers, hidden, n_heads = int(c.num_hidden_layers), int(c.hidden_size), int(c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or hidden // n_heads)
    act_name = c.hidden_activation if arch == "gemma3" else c.hidden_act
    if act_name not in ACTIVATIONS:
        field_name = "hidden_activation" if arch == "gemma3" else "hidden_act"
        raise _refuse(field_name, act_name, f"hetero computes {', '.join(ACTIVATIONS)}")
    attn_bias = bool(getattr(c, "attention_bias", False)) if arch in ("llama", "qwen3", "gemma3") else False
    out: dict[str, Any] = dict(
        arch=arch, n_layers=n_layers, hidden=hidden, n_heads=n_heads,
        n_kv_heads=int(c.num_key_value_heads or n_heads), ffn=int(c.intermediate_size), vocab=int(c.vocab_size),
        context_length=int(c.max_position_embeddings), rms_eps=float(c.rms_norm_eps), head_dim=head_dim,
        qkv_bias=arch == "qwen2" or attn_bias, o_bias=attn_bias,
        mlp_bias=bool(getattr(c, "mlp_bias", False)) if arch == "llama" else False,
        act=ACTIVATIONS[act_name], tie_embeddings=bool(c.tie_word_embeddings),
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id[0] if isinstance(c.eos_token_id, list) else c.eos_token_id,
    )
    # sliding windows: Mistral and Phi-3 window every layer; Qwen2/3 and Gemma 3 the layers layer_types says
    sw = getattr(c, "sliding_window", None)
    if arch in ("mistral", "phi3"):
        out["windows"] = (int(sw),) * n_layers if sw else ()
    elif arch in ("qwen2", "qwen3", "gemma3"):
        types = list(c.layer_types)
        bad = [t for t in types if t not in ("full_attention", "sliding_attention")]
        if bad or len(types) != n_layers:
            raise _refuse("layer_types", types, "one of full_attention/sliding_attention per layer")
        if "sliding_attention" in types and not sw:
            raise _refuse("sliding_window", sw, "layer_types has sliding_attention layers")
        out["windows"] = tuple(int(sw) if t == "sliding_attention" else 0 for t in types)
    # RoPE
    rp = c.rope_parameters
    if arch == "gemma3":
        theta, scaling, _ = _rope("rope_parameters.full_attention", rp["full_attention"], arch)
        local_theta, local_scaling, _ = _rope("rope_parameters.sliding_attention", rp["sliding_attention"], arch)
        if local_scaling:
            raise _refuse("rope_parameters.sliding_attention.rope_type", local_scaling["rope_type"],
                          "Gemma 3's windowed layers use plain RoPE")
        out["local_rope_theta"] = local_theta
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(c, name, None) is not None:
                raise _refuse(name, getattr(c, name), "hetero does not softcap")
        if getattr(c, "use_bidirectional_attention", False):
            raise _refuse("use_bidirectional_attention", True, "hetero's attention is causal")
        out.update(qk_norm=True, post_norms=True,
                   embed_scale=float(f32(hidden**0.5)), attn_scale=float(c.query_pre_attn_scalar) ** -0.5)
    else:
        if rp.get("rope_type") == "longrope" and "original_max_position_embeddings" not in rp:
            rp = {**rp, "original_max_position_embeddings": getattr(c, "original_max_position_embeddings", None)}
        theta, scaling, partial = _rope("rope_parameters", rp, arch)
        if partial is not None and float(partial) != 1.0:
            out["rotary_dim"] = int(head_dim * float(partial))
        if arch == "qwen3":
            out["qk_norm"] = True
    if scaling.get("rope_type") == "longrope":
        scaling, out["context_length"] = longrope(scaling, out["context_length"])
    out.update(rope_theta=theta, rope_scaling=scaling)
    return out


def longrope(p: dict[str, Any], max_pos: int) -> tuple[dict[str, Any], int]:
    """Phi-3's longrope, as transformers computes it up to original_max_position_embeddings: the short factors
    and the attention factor on cos/sin. Past that length transformers switches every position to the long
    factors (re-rotating nothing already cached); hetero keeps the context to the short regime instead."""
    orig = int(p["original_max_position_embeddings"])
    factor = float(p.get("factor") or max_pos / orig)
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return ({"rope_type": "longrope", "short_factor": [float(x) for x in p["short_factor"]],
             "attention_factor": float(attention)}, min(max_pos, orig))


def f32(x: float) -> float:
    """x rounded to float32 (transformers keeps Gemma's embedding scale as a float32 tensor)."""
    return struct.unpack("f", struct.pack("f", x))[0] if math.isfinite(x) else x
