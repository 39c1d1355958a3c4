"""hetero's prefill handed to llama.cpp through its sequence state: llama.cpp continues it."""

from __future__ import annotations

import numpy as np
import pytest

from hetero.runtime import Runtime

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the `bench` extra)")


def test_llama_cpp_continues_hetero_prefill(default_model) -> None:
    from hetero.adapters.llamacpp import greedy_continue, last_logits, load_into_llama

    tok = default_model.tokenizer
    s = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                add_generation_prompt=True, tokenize=False)
    ids = tok(s, add_special_tokens=False)["input_ids"]
    llm = llama_cpp.Llama(model_path=str(default_model.path), n_ctx=256, n_threads=2, verbose=False)
    llm.eval(ids)
    own_logits = last_logits(llm).copy()
    own = greedy_continue(llm, int(np.argmax(own_logits)), 20)
    r = Runtime(default_model, chunk=64).prefill(ids)
    load_into_llama(llm, r.cache, ids)
    assert llm.n_tokens == len(ids)
    hand = greedy_continue(llm, int(r.logits.argmax()), 20)
    # llama.cpp multiplies Q4_1 weights with Q8_1-quantized activations, hetero's float method the same
    # weights dequantized with fp32 activations: the logits differ by a fraction of a logit, so the
    # continuations agree wherever llama.cpp's own top-2 margin exceeds that difference
    assert float(np.abs(r.logits.numpy() - own_logits).max()) < 1.5
    assert hand == own, (tok.decode(own), tok.decode(hand))
    assert "Paris" in tok.decode(hand)


def test_wrong_ids_length_is_refused(default_model) -> None:
    from hetero.adapters.llamacpp import load_into_llama
    from hetero.errors import ConfigError

    r = Runtime(default_model, chunk=64).prefill([1, 2, 3])
    llm = llama_cpp.Llama(model_path=str(default_model.path), n_ctx=64, n_threads=1, verbose=False)
    with pytest.raises(ConfigError, match="ids"):
        load_into_llama(llm, r.cache, [1, 2])
