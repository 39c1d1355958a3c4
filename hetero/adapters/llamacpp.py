"""Hand a hetero prefill to llama.cpp (llama-cpp-python): hetero's K/V written as llama.cpp's sequence state.

hetero as the prefill accelerator of another engine: the K/V of the prompt go into llama.cpp's cache
through its sequence-state API (`llama_state_seq_set_data`), so llama.cpp decodes without its own
prefill. The state of one sequence (one stream) is, in llama.cpp's `llama_kv_cache::state_write` order:

    8 header bytes (copied from a state llama.cpp writes) | u32 n_stream=1 | u32 n_cells | n_cells × (i32 pos, u32 n_seq=1, i32 seq_id)
    u32 v_trans | u32 n_layer | per layer: i32 k_type, u64 k_row_bytes, n_cells rows [n_kv·D]
    per layer (v_trans=1): i32 v_type, u32 v_elem_bytes, u32 n_kv·D, then [n_kv·D, n_cells] transposed
                (v_trans=0): i32 v_type, u64 v_row_bytes, n_cells rows

llama.cpp's K is roped in its own head layout: GGUF permutes Q/K rows so RoPE rotates adjacent pairs
(2i, 2i+1) where hetero (as HF) rotates (i, i+D/2); `_llama_head_order` converts. Cache type f16.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import numpy as np

from hetero.errors import ConfigError
from hetero.kv_cache import KVCache

GGML_TYPE_F16 = 1


def _llama_head_order(k: np.ndarray) -> np.ndarray:
    """[n_kv, T, D] in HF rotate-half order → llama.cpp's interleaved order: out[2i+s] = in[s·D/2 + i]."""
    n_kv, t, d = k.shape
    return k.reshape(n_kv, t, 2, d // 2).swapaxes(-1, -2).reshape(n_kv, t, d)


def state_bytes(cache: KVCache, header: bytes, v_trans: bool, seq_id: int = 0) -> bytes:
    """llama.cpp's sequence state (f16 K/V) holding the cache's valid positions."""
    n, cfg = cache.length, cache.config
    parts = [header, struct.pack("<II", 1, n)]
    parts.append(np.array([(p, 1, seq_id) for p in range(n)], dtype=np.int32).tobytes())
    parts.append(struct.pack("<II", int(v_trans), cfg.n_layers))
    width = cfg.n_kv_heads * cfg.head_dim
    for layer in range(cfg.n_layers):
        k, _ = cache.keys_values(layer)
        rows = _llama_head_order(k).swapaxes(0, 1).reshape(n, width)  # [T, n_kv·D]
        parts.append(struct.pack("<iQ", GGML_TYPE_F16, width * 2))
        parts.append(rows.astype(np.float16).tobytes())
    for layer in range(cfg.n_layers):
        _, v = cache.keys_values(layer)
        rows = v.swapaxes(0, 1).reshape(n, width).astype(np.float16)
        if v_trans:
            parts.append(struct.pack("<iII", GGML_TYPE_F16, 2, width))
            parts.append(rows.T.tobytes())
        else:
            parts.append(struct.pack("<iQ", GGML_TYPE_F16, width * 2))
            parts.append(rows.tobytes())
    return b"".join(parts)


def _layout(llm: Any) -> tuple[bytes, bool]:
    """The state header and whether this context stores V transposed, read from a state llama.cpp writes."""
    import llama_cpp

    ctx = llm._ctx.ctx
    llm.reset()
    llm.eval([llm.token_bos()])
    size = llama_cpp.llama_state_seq_get_size(ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    n = llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0)
    data = bytes(buf)[:n]
    _, n_stream, cells = struct.unpack_from("<QII", data, 0)
    if n_stream != 1 or cells != 1:
        raise ConfigError(f"unexpected llama.cpp state layout (streams {n_stream}, cells {cells})")
    (v_trans,) = struct.unpack_from("<I", data, 16 + 12 * cells)
    return data[:8], bool(v_trans)


def load_into_llama(llm: Any, cache: KVCache, ids: list[int]) -> None:
    """Replace llama.cpp's sequence 0 by hetero's cache of `ids` (its K/V); llama.cpp then continues it."""
    import llama_cpp

    if len(ids) != cache.length:
        raise ConfigError(f"ids has {len(ids)} tokens but the cache holds {cache.length}")
    if cache.length + 1 > llm.n_ctx():
        raise ConfigError(f"llama.cpp context n_ctx={llm.n_ctx()} is too small for {cache.length} cached tokens")
    header, v_trans = _layout(llm)
    data = state_bytes(cache, header, v_trans)
    llm.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    if llama_cpp.llama_state_seq_set_data(llm._ctx.ctx, buf, len(data), 0) != len(data):
        raise ConfigError("llama.cpp refused the sequence state written from hetero's cache")
    llm.input_ids[: len(ids)] = ids
    llm.n_tokens = len(ids)


def last_logits(llm: Any) -> np.ndarray:
    """The logits of the last token llama.cpp evaluated ([vocab], a view)."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def greedy_continue(llm: Any, first: int, max_new_tokens: int, stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """llama.cpp's greedy decode after a hand-off: `first` (chosen from hetero's prefill logits) onwards."""
    out = [first]
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        llm.eval([out[-1]])
        out.append(int(np.argmax(last_logits(llm))))
    return out
