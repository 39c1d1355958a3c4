"""Write small GGUF files for tests with the `gguf` package's writer (the format llama.cpp reads)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from hetero.loader import _GGUF_NAMES, Model, permute


def write_gguf(model: Model, path: Path, qtypes: dict[str, str] | None = None, arch: str | None = None,
               extra_kv: dict[str, object] | None = None, extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Save `model` as GGUF; `qtypes` maps a field ("wq", "w_up", ...) to F32/F16/Q8_0/Q4_0/Q4_1/Q5_0;
    extra_kv: more metadata (key without the "<arch>." prefix -> int/float/str); extra_tensors: more tensors."""
    cfg, w = model.config, model.weights
    arch = arch or cfg.arch
    qtypes = qtypes or {}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            writer.add_string(f"{arch}.{key}", str(value))
        elif isinstance(value, int):
            writer.add_uint32(f"{arch}.{key}", value)
        else:
            writer.add_float32(f"{arch}.{key}", value)
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.context_length)
    writer.add_embedding_length(cfg.hidden)
    writer.add_feed_forward_length(cfg.ffn)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_vocab_size(cfg.vocab)

    def add(name: str, t: torch.Tensor, field: str = "") -> None:
        arr = np.asarray(t, dtype=np.float32)
        qt = gguf.GGMLQuantizationType[qtypes.get(field, "F32")]
        if qt == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, arr)
        else:
            writer.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    add("token_embd.weight", w.tok_emb)
    add("output_norm.weight", w.norm)
    if w.lm_head is not w.tok_emb:
        add("output.weight", w.lm_head)
    for name, t in (extra_tensors or {}).items():
        add(name, t)
    for i, lw in enumerate(w.layers):
        fused = arch == "phi3"  # llama.cpp's Phi-3: attn_qkv = q|k|v rows, ffn_up = gate|up rows
        if fused:
            add(f"blk.{i}.attn_qkv.weight", torch.cat([lw.wq, lw.wk, lw.wv]))
            add(f"blk.{i}.ffn_up.weight", torch.cat([lw.w_gate, lw.w_up]))
        for field, name in _GGUF_NAMES.items():
            t = getattr(lw, field)
            if t is None or (fused and field in ("wq", "wk", "wv", "w_gate", "w_up")):
                continue
            if arch in ("llama", "mistral") and field in ("wq", "wk"):
                t = torch.from_numpy(permute(t.numpy(), cfg.n_heads if field == "wq" else cfg.n_kv_heads))
            add(f"blk.{i}.{name}", t, field)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
