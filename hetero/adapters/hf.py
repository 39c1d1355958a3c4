"""Hand a hetero prefill to Hugging Face `transformers` decoding: KV cache → `DynamicCache`.

The prefill already produced the last prompt token's logits, so the first new token is chosen from
them; `generate()` then continues with that token appended and only runs decode steps over our cache.

Importing this module loads neither torch nor transformers (its functions do): a program that imports it first
still lets `hetero.make_runtime` see torch unloaded, or an entry point choose OpenMP's wait policy before torch
loads (`hetero.threads`); torch imported here at the top made `ExecutionPlan.for_host` warn that torch's OpenMP
threads spin in the README's own snippet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hetero.kv_cache import KVCache
from hetero.loader import Model
from hetero.runtime import PrefillResult

if TYPE_CHECKING:
    import torch


def to_hf_model(model: Model) -> "torch.nn.Module":
    """A transformers `*ForCausalLM` sharing hetero's float weights (no copy, no random init)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = model.config
    hf_cfg = AutoConfig.for_model(**cfg.to_hf())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    w = model.weights
    state = {"model.embed_tokens.weight": w.tok_emb, "model.norm.weight": w.norm, "lm_head.weight": w.lm_head}
    names = {"attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
             "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight", "ffn_norm": "post_attention_layernorm.weight",
             "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
             "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}
    for i, lw in enumerate(w.layers):
        for ours, theirs in names.items():
            t = getattr(lw, ours)
            if t is not None:
                state[f"model.layers.{i}.{theirs}"] = t
    hf.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings:
        hf.tie_weights()
    # Modules with buffers (the RoPE tables) were created on the meta device: rebuild them on the CPU.
    for name, module in list(hf.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent_name, _, attr = name.rpartition(".")
            setattr(hf.get_submodule(parent_name), attr, type(module)(config=hf_cfg))
    missing = [n for n, p in list(hf.named_parameters()) + list(hf.named_buffers()) if p.is_meta]
    assert not missing, f"parameters left uninitialised: {missing[:5]}"
    return hf.eval()


def to_dynamic_cache(cache: KVCache, hf_config: object | None = None) -> "object":
    """A `DynamicCache` holding copies of the cache's valid positions ([1, n_kv, length, D] per layer)."""
    import torch
    from transformers import DynamicCache

    dc = DynamicCache(config=hf_config) if hf_config is not None else DynamicCache()
    for layer in range(cache.config.n_layers):
        k, v = cache.keys_values(layer)  # numpy views: copied into the DynamicCache's tensors
        dc.update(torch.from_numpy(k.copy()).unsqueeze(0), torch.from_numpy(v.copy()).unsqueeze(0), layer)
    return dc


def generate(hf_model: "torch.nn.Module", prompt_ids: "np.ndarray | torch.Tensor", result: PrefillResult,
             max_new_tokens: int) -> list[int]:
    """Greedy continuation of a prefill with `hf_model.generate`; returns the new token ids."""
    import torch

    if max_new_tokens <= 0:
        return []
    first = int(np.argmax(result.logits))
    eos = hf_model.config.eos_token_id
    if max_new_tokens == 1 or first == eos:
        return [first]
    prompt_ids = torch.as_tensor(np.asarray(prompt_ids), dtype=torch.long)
    ids = torch.cat([prompt_ids.view(1, -1), torch.tensor([[first]])], dim=1)
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=to_dynamic_cache(result.cache, hf_model.config),
            max_new_tokens=max_new_tokens - 1,
            do_sample=False,
            pad_token_id=eos,
        )
    return out[0, prompt_ids.numel():].tolist()
