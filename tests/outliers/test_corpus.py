"""Shipped corpora: checksums, disjointness (hetero/outliers/corpus.py)."""

from __future__ import annotations

import pytest

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
