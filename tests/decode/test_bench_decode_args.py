"""bench/decode.py's options: bad contexts are a one-line error; a plain-only result renders its table alone."""

from __future__ import annotations

import argparse

import pytest

from bench import decode as bench_decode
from hetero.errors import ConfigError


def _args(**kw) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    bench_decode.add_args(ap)
    return ap.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


@pytest.mark.parametrize("contexts", ["0", "x", "", "256,9000"])
def test_bad_contexts_are_refused_before_any_work(contexts) -> None:
    with pytest.raises(ConfigError, match="--contexts"):
        bench_decode.run(_args(contexts=contexts, peers="none"))


def test_plain_only_result_renders_the_plain_table_alone(tmp_path) -> None:
    r = {"model": "m", "command": "python bench/decode.py --plain-only --contexts 1024", "threads": 2, "repeats": 3,
         "machine": "cpu", "peers": {"llama_cpp_q4_0": "llama.cpp Q4_0"}, "skipped": {}, "speculative": [], "e2e": [],
         "plain": [{"context": 1024, "hetero": 120.0, "float": 25.0, "hf": 20.0, "llama_cpp_q4_0": 110.0,
                    "best_peer": "llama_cpp_q4_0", "hetero_over_best_peer": 1.09, "load_before": 0.1, "load_after": 0.2,
                    "rounds": {"hetero": [120.0], "llama_cpp_q4_0": [110.0]}}]}
    bench_decode.write_md(r, tmp_path / "decode_plain.md")
    md = (tmp_path / "decode_plain.md").read_text()
    assert "--plain-only --contexts 1024" in md and "| 1024 | 120.0 |" in md and "| 1.09 |" in md
    assert "speculation" not in md and "End to end" not in md
