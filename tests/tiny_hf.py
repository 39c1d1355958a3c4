"""Tiny random-weight models from transformers' own config classes, saved as HF directories.

Weights are drawn so that logits are O(1) (transformers' init gives near-zero logits, which hide errors):
linears ~ N(0, 1/in), norms 1 + N(0, 0.1) (Gemma's stored w: N(0, 0.1), its norm is 1 + w), biases
N(0, 0.1), embeddings N(0, 1) (Gemma: N(0, 4/hidden), its embedding is scaled by sqrt(hidden)).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# a small shape every architecture shares: hidden 64, 4 heads of 16, 2 KV heads, 2 layers
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")


def config_of(arch: str, **overrides: Any):
    """transformers' config object of `arch` at the tiny size (overrides: config.json fields)."""
    import transformers as T

    cls = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config,
           "gemma3": T.Gemma3TextConfig, "phi3": T.Phi3Config}[arch]
    kw: dict[str, Any] = dict(BASE)
    if arch in ("llama", "mistral", "qwen3", "gemma3"):
        kw["head_dim"] = 16
    if arch == "gemma3":
        kw.update(query_pre_attn_scalar=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    if arch == "phi3":
        kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return cls(**kw)


def build(arch: str, path: Path, seed: int = 0, **overrides: Any):
    """A tiny `arch` model with O(1) logits, saved to `path`; returns the transformers model (eval, eager)."""
    from transformers import AutoModelForCausalLM

    cfg = config_of(arch, **overrides)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    gemma = arch == "gemma3"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0 if gemma else 1) + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (2 * cfg.hidden_size**-0.5 if gemma else 1.0))
            else:  # [out, in] linears (and an untied lm_head)
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5 * (2.0 if "lm_head" in name else 1.0))
    model.save_pretrained(path)
    return model


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0]


def greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    """n greedy tokens by transformers' forward, through end-of-sequence ids (generate's min_new_tokens would
    mask them out)."""
    out = ids.tolist()
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[ids.numel():]
