"""Shipped corpora: checksums, disjointness (hetero/outliers/corpus.py)."""

from __future__ import annotations

import pytest
import torch

from hetero.errors import ConfigError
from hetero.outliers.corpus import CORPORA, load_corpus


def test_corpora_load_and_are_disjoint():
    sotu, austen = load_corpus("sotu"), load_corpus("austen")
    assert len(sotu) > 150_000 and len(austen) > 150_000
    assert CORPORA["sotu"].use == "calibration" and CORPORA["austen"].use == "evaluation"
    # no shared 200-character passage
    probes = {austen[i : i + 200] for i in range(0, len(austen) - 200, 5000)}
    assert not any(p in sotu for p in probes)


def test_unknown_corpus(tmp_path):
    with pytest.raises(ConfigError, match="corpus must be one of"):
        load_corpus("nope")
    f = tmp_path / "t.txt"
    f.write_text("hello")
    assert load_corpus(str(f)) == "hello"


class _BosTokenizer:
    """A character tokenizer that, like Gemma's, puts <bos> (id 2) before every text unless told not to."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [10 + ord(c) % 50 for c in text]
        return {"input_ids": ([2] if add_special_tokens else []) + ids}


def test_token_windows_start_with_the_tokenizers_leading_special_tokens():
    """Every window starts as a prompt does (Gemma's <bos>), the text tokens follow in order, none repeated;
    a tokenizer without leading special tokens gets plain windows."""
    from hetero.outliers.calibration import token_windows

    tok = _BosTokenizer()
    text = "abcdefghijklmnopqrstuvwxyz" * 3
    wins = token_windows(tok, text, 40, 8)
    assert all(w[0] == 2 and w.numel() <= 8 for w in wins)
    assert torch.cat([w[1:] for w in wins]).tolist() == tok(text, add_special_tokens=False)["input_ids"][:40]

    class Plain(_BosTokenizer):
        def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
            return super().__call__(text, False)

    plain = token_windows(Plain(), text, 40, 8)
    assert [w.numel() for w in plain] == [8] * 5 and torch.cat(plain).tolist() == Plain()(text)["input_ids"][:40]
