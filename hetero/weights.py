"""A model's float weights: the decoder layer's linears by activation site, and the tensors of every layer.

Torch-free, so that a warm INT8 start can name the sites and read a cached model's weights as mapped numpy
arrays (`weight_arrays`, `loader.Model.arrays`) without importing torch; the float math on these
tensors is `model`'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# Activation sites of a layer: the input shared by one group of linears (it is quantized once).
#   h ─► RMSNorm ─► [attn_in] ─► wq, wk, wv                                    (qkv)
#   a ─► [o_in] ─► wo (─► RMSNorm) ─► +h ─► RMSNorm ─► [ffn_in] ─► w_gate, w_up
#        act(gate)·up ─► [down_in] ─► w_down (─► RMSNorm) ─► +h                (o_ffn)
# (the norms in brackets: Gemma 3's post-norms; QK-norm sits in `attention`, before RoPE)
SITES = ("attn_in", "o_in", "ffn_in", "down_in")
SITE_LINEARS: dict[str, tuple[str, ...]] = {  # LayerWeights fields of the linears reading each site
    "attn_in": ("wq", "wk", "wv"),
    "o_in": ("wo",),
    "ffn_in": ("w_gate", "w_up"),
    "down_in": ("w_down",),
}
SITE_BIASES: dict[str, tuple[str, ...]] = {  # LayerWeights field of each linear's bias (None when it has none)
    "attn_in": ("bq", "bk", "bv"),
    "o_in": ("bo",),
    "ffn_in": ("b_gate", "b_up"),
    "down_in": ("b_down",),
}

@dataclass(slots=True)
class LayerWeights:
    """One decoder layer; linear weights are [out, in] like `nn.Linear`."""

    attn_norm: torch.Tensor  # [hidden]
    wq: torch.Tensor  # [n_heads*D, hidden]
    wk: torch.Tensor  # [n_kv*D, hidden]
    wv: torch.Tensor  # [n_kv*D, hidden]
    wo: torch.Tensor  # [hidden, n_heads*D]
    ffn_norm: torch.Tensor  # [hidden]
    w_gate: torch.Tensor  # [ffn, hidden]
    w_up: torch.Tensor  # [ffn, hidden]
    w_down: torch.Tensor  # [hidden, ffn]
    bq: torch.Tensor | None = None  # [n_heads*D] (cfg.qkv_bias)
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    bo: torch.Tensor | None = None  # [hidden] (cfg.o_bias)
    b_gate: torch.Tensor | None = None  # [ffn] (cfg.mlp_bias)
    b_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None  # [hidden]
    q_norm: torch.Tensor | None = None  # [D] (cfg.qk_norm)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # [hidden] (cfg.post_norms)
    post_ffn_norm: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The layer's tensors it has (a set-up step hands back their mapped pages once it has read them:
        `loader.release_pages`)."""
        return [t for f in dataclasses.fields(self) if (t := getattr(self, f.name)) is not None]


@dataclass(slots=True)
class Weights:
    tok_emb: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as tok_emb when tied
    embed_scale: float = 1.0  # cfg.embed_scale: the embedding rows are multiplied by it (Gemma 3)


def weight_arrays(w: Weights) -> dict[str, np.ndarray]:
    """The tensors of `w` as numpy views, by the names a cache file stores them under: "tok_emb", "norm",
    "lm_head", "layers.{i}.{field}" (fields that are None are absent)."""
    out = {"tok_emb": w.tok_emb.numpy(), "norm": w.norm.numpy(), "lm_head": w.lm_head.numpy()}
    for i, lw in enumerate(w.layers):
        for f in dataclasses.fields(lw):
            t = getattr(lw, f.name)
            if t is not None:
                out[f"layers.{i}.{f.name}"] = t.numpy()
    return out
