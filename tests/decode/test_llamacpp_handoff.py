"""hetero's prefill handed to llama.cpp through its sequence state: llama.cpp continues it."""

from __future__ import annotations

import numpy as np
import pytest

from hetero.runtime import Runtime

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the `bench` extra)")


def _llama_k(data: bytes, n: int, n_layers: int, width: int) -> np.ndarray:
    """K rows [n_layers, n, width] from a llama.cpp sequence state (the layout `state_bytes` writes)."""
    off = 16 + 12 * n + 8
    out = []
    for _ in range(n_layers):
        off += 12
        out.append(np.frombuffer(data, np.float16, n * width, off).reshape(n, width))
        off += 2 * n * width
    return np.stack(out).astype(np.float32)


def test_hetero_kv_lands_where_llama_cpp_keeps_its_own(default_model) -> None:
    """hetero's K in llama.cpp's layout matches the K llama.cpp computes itself (same layout, close values)."""
    import ctypes

    from hetero.adapters.llamacpp import _layout, state_bytes

    tok = default_model.tokenizer
    ids = tok("The quick brown fox jumps over the lazy dog near the river bank.")["input_ids"]
    llm = llama_cpp.Llama(model_path=str(default_model.path), n_ctx=128, n_threads=2, verbose=False)
    header, v_trans = _layout(llm)
    llm.reset()
    llm.eval(ids)
    size = llama_cpp.llama_state_seq_get_size(llm._ctx.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    n = llama_cpp.llama_state_seq_get_data(llm._ctx.ctx, buf, size, 0)
    own = bytes(buf)[:n]
    r = Runtime(default_model, chunk=64).prefill(ids)
    ours = state_bytes(r.cache, header, v_trans)
    assert len(ours) == len(own) and ours[:16 + 12 * len(ids)] == own[:16 + 12 * len(ids)]
    cfg = default_model.config
    a = _llama_k(own, len(ids), cfg.n_layers, cfg.kv_dim)
    b = _llama_k(ours, len(ids), cfg.n_layers, cfg.kv_dim)
    # Q4_1 x Q8_1 (llama.cpp) vs dequantized Q4_1 x fp32 (hetero): a few percent apart, never a permutation
    assert float(np.abs(a - b).mean() / np.abs(a).mean()) < 0.1


def test_llama_cpp_continues_hetero_prefill(default_model) -> None:
    from hetero.adapters.llamacpp import greedy_continue, load_into_llama

    tok = default_model.tokenizer
    s = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                add_generation_prompt=True, tokenize=False)
    ids = tok(s, add_special_tokens=False)["input_ids"]
    llm = llama_cpp.Llama(model_path=str(default_model.path), n_ctx=256, n_threads=2, verbose=False)
    r = Runtime(default_model, chunk=64).prefill(ids)
    load_into_llama(llm, r.cache, ids)
    assert llm.n_tokens == len(ids)
    hand = greedy_continue(llm, int(r.logits.argmax()), 20)
    # llama.cpp decodes on hetero's K/V: the float method's own greedy answer (an exact token-for-token
    # match with llama.cpp's own prefill is not expected: its Q8_1 activations move near-tied logits)
    assert "Paris" in tok.decode(hand)


def test_wrong_ids_length_is_refused(default_model) -> None:
    from hetero.adapters.llamacpp import load_into_llama
    from hetero.errors import ConfigError

    r = Runtime(default_model, chunk=64).prefill([1, 2, 3])
    llm = llama_cpp.Llama(model_path=str(default_model.path), n_ctx=64, n_threads=1, verbose=False)
    with pytest.raises(ConfigError, match="ids"):
        load_into_llama(llm, r.cache, [1, 2])
