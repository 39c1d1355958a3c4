"""Model configuration of the Llama family (Llama, SmolLM, Mistral, Qwen2), read from GGUF or HF."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hetero.errors import ModelFormatError

# Architectures whose decoder layer is the Llama block (RMSNorm, RoPE, GQA attention, SwiGLU).
# Qwen2 adds biases on Q/K/V; Mistral's sliding window only matters past its window length.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and constants of one decoder-only Llama-family model."""

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
    qkv_bias: bool = False  # Qwen2
    tie_embeddings: bool = True
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # {"rope_type": ..., "factor": ...}
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ModelFormatError(
                f"unsupported architecture {self.arch!r}: hetero supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn", "vocab", "context_length"):
            if getattr(self, name) <= 0:
                raise ModelFormatError(f"model config field {name} must be > 0, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ModelFormatError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelFormatError(f"unsupported rope scaling {rope_type!r}: hetero supports {SUPPORTED_ROPE_TYPES}")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face `config.json` dict."""
        arch = hf.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelFormatError(
                f"unsupported architecture {arch!r}: hetero supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
            theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
            rope.pop("rope_theta", None)
            if "type" in rope and "rope_type" not in rope:
                rope["rope_type"] = rope.pop("type")
            hidden = int(hf["hidden_size"])
            n_heads = int(hf["num_attention_heads"])
            eos = hf.get("eos_token_id")
            return cls(
                arch=arch,
                n_layers=int(hf["num_hidden_layers"]),
                hidden=hidden,
                n_heads=n_heads,
                n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
                ffn=int(hf["intermediate_size"]),
                vocab=int(hf["vocab_size"]),
                context_length=int(hf.get("max_position_embeddings", 2048)),
                rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                head_dim=int(hf.get("head_dim") or hidden // n_heads),
                qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
                tie_embeddings=bool(hf.get("tie_word_embeddings", arch != "mistral")),
                rope_scaling=rope,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=eos[0] if isinstance(eos, list) else eos,
            )
        except KeyError as e:
            raise ModelFormatError(f"config.json lacks the field {e.args[0]!r}") from e

    def to_hf(self) -> dict[str, Any]:
        """As a Hugging Face config dict (for the decoding adapter)."""
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
