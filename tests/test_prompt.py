"""Prompt checks at the edge and bounds on C and new tokens."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetero.errors import ConfigError
from hetero.prompt import check_text, encode_prompt, new_token_budget
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_non_utf8_argv_is_one_line_and_exit_2(tmp_path):
    # bytes that are not UTF-8 reach Python as lone surrogates; the CLI refuses them before loading anything
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HETERO_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "hetero", "run", os.fsdecode(b"caf\xe9")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("hetero: error: prompt is not valid UTF-8 (byte 0xe9 at character 3): pass UTF-8 "
                                   "text (check the terminal's locale)")


def test_check_text():
    assert check_text("café") == "café"
    with pytest.raises(ConfigError, match="empty"):
        check_text(" \n")
    with pytest.raises(ConfigError, match="system message is not valid UTF-8"):
        check_text("a\udcff", "system message")


def test_new_tokens_stop_at_the_context(caplog):
    assert new_token_budget(100, 64, 8192) == 64
    with caplog.at_level(logging.WARNING):
        assert new_token_budget(8150, 100, 8192) == 42
    assert "leaves room for 42 new tokens" in caplog.text
    assert new_token_budget(8192, 0, 8192) == 0  # a prefill alone fits
    with pytest.raises(ConfigError, match="fills the model's context of 8192: no room for a new token"):
        new_token_budget(8192, 5, 8192)  # refused before the prefill, not after it
    with pytest.raises(ConfigError, match="max_new_tokens"):
        new_token_budget(1, -1, 10)


def test_chunk_is_bounded_by_the_context():
    model = make_tiny_model()  # context 512
    with pytest.raises(ConfigError, match="at most the model's context length 512, got 100000"):
        Runtime(model, chunk=100000)
    for bad in (0, -3, 2.5, True, "64"):
        with pytest.raises(ConfigError, match="chunk must be a positive integer"):
            Runtime(model, chunk=bad)


def test_chunk_is_bounded_by_memory(monkeypatch):
    import psutil

    from hetero.npu.graph_backend import check_graph_memory, graph_memory_bytes

    cfg = make_tiny_model().config
    need = graph_memory_bytes(cfg, 512, cfg.n_layers)
    check_graph_memory(cfg, 512, cfg.n_layers)  # a few MiB: fits
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": need})())
    with pytest.raises(ConfigError, match="chunk 512 needs about .* use a smaller chunk"):
        check_graph_memory(cfg, 512, cfg.n_layers)


class _Tok:
    chat_template = "x"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] * add_special_tokens + [ord(c) for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_encode_prompt_with_system_message():
    tok = _Tok()
    assert encode_prompt(tok, "hi", system="be brief") == [ord(c) for c in "<system>be brief<user>hi<assistant>"]
    assert encode_prompt(tok, "hi", raw=True) == [1, ord("h"), ord("i")]
    with pytest.raises(ConfigError, match="--system needs the model's chat template"):
        encode_prompt(tok, "hi", system="x", raw=True)


@pytest.mark.parametrize("room", [0, 1, 3])
def test_a_prompt_at_the_context_edge_is_refused_before_the_prefill_or_answered(default_model, monkeypatch, capsys,
                                                                                 room):
    # a prompt leaving no room for a new token used to fail only after its whole prefill
    import dataclasses
    import json

    import hetero.loader
    from hetero.cli import main

    question = "What is the capital of France? Answer in one sentence."
    n = len(encode_prompt(default_model.tokenizer, question))
    small = dataclasses.replace(default_model, config=dataclasses.replace(default_model.config,
                                                                          context_length=n + room))
    monkeypatch.setattr(hetero.loader, "load_model", lambda path=None: small)
    prefills = []
    real = Runtime.prefill
    monkeypatch.setattr(Runtime, "prefill", lambda self, *a, **k: prefills.append(1) or real(self, *a, **k))
    # the default speculation (lookup): a drafted tree is cut to the context's room, and so are the step costs
    code = main(["run", question, "-n", "8", "--method", "float", "--chunk", "32", "--json"])
    captured = capsys.readouterr()
    if room == 0:
        assert code == 2 and not prefills
        assert captured.err.strip().splitlines() == [
            f"hetero: error: the prompt of {n} tokens fills the model's context of {n}: no room for a new token "
            f"(shorten the prompt, or ask for -n 0)"]
    else:
        assert code == 0 and prefills, captured.err
        out = json.loads(captured.out.strip().splitlines()[-1])
        assert 1 <= out["new_tokens"] <= room
