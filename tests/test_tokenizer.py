"""hetero's tokenizer (`tokenizers` + `jinja2`) gives transformers' token ids, chat prompts and text."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero.paths import cache_dir
from hetero.tokenizer import Tokenizer

PROMPTS = ["What is the capital of France? Answer in one sentence.", "hi", "  leading and trailing spaces  ",
           "Ünïcödé — «quotes», emoji 🙂, 中文, tabs\tand\nnewlines", "<|im_start|>user text holding a special token",
           "code: def f(x):\n    return x ** 2  # comment"]
SYSTEMS = [None, "You are a helpful assistant.", "Answer briefly."]


def _folders() -> list[Path]:
    """Every tokenizer the test cache holds (the default model's; Gemma 3's where it was fetched)."""
    return sorted(p for p in (cache_dir() / "models").glob("*/tokenizer") if (p / "tokenizer.json").is_file())


@pytest.fixture(scope="module", params=range(2))
def pair(request, default_model):
    from transformers import AutoTokenizer

    folders = _folders()
    if request.param >= len(folders):
        pytest.skip("one tokenizer in this cache")
    return Tokenizer.from_dir(folders[request.param]), AutoTokenizer.from_pretrained(str(folders[request.param]))


def test_ids_and_text_equal_transformers(pair) -> None:
    ours, hf = pair
    for text in PROMPTS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == list(hf(text, add_special_tokens=special)["input_ids"]), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids[-1]) == hf.decode(ids[-1])  # one id, as an int
    assert ours.eos_token_id == hf.eos_token_id and ours.bos_token_id == hf.bos_token_id
    vocab = hf.get_vocab()
    for token in ("<|im_end|>", "<|endoftext|>", "<eos>", "hello", "Ġthe", "no such token"):
        assert ours.token_to_id(token) == vocab.get(token)


def test_chat_template_equals_transformers(pair) -> None:
    ours, hf = pair
    if hf.chat_template is None:
        pytest.skip("no chat template")
    for text in PROMPTS:
        for system in SYSTEMS:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            for gen in (True, False):
                want = hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
                assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == want
                assert ours.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True) == \
                    list(hf(want, add_special_tokens=False)["input_ids"])
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "And now?"}]
    assert ours.apply_chat_template(turns, True) == hf.apply_chat_template(turns, add_generation_prompt=True,
                                                                           tokenize=False)


def test_wrapped_transformers_tokenizer_is_the_same(pair) -> None:
    """What `Tokenizer.of` wraps (a tokenizer transformers converted) equals the saved one read back."""
    ours, hf = pair
    wrapped = Tokenizer.of(hf)
    assert wrapped.special == ours.special and wrapped.chat_template == ours.chat_template
    for text in PROMPTS:
        assert wrapped(text)["input_ids"] == ours(text)["input_ids"]
        assert wrapped.decode(ours(text)["input_ids"], True) == ours.decode(ours(text)["input_ids"], True)
