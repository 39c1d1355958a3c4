"""The pure parts of `bench/peer_accuracy.py`: scoring windows, the frontier, the table and the figure; no peer
runs here (the peers are an optional extra)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.peer_accuracy import ENGINE_LABELS, HOW, dominated_by, frontier_sentence, markdown, plot, score_windows
from bench.peer_engines import PEERS, window_score
from hetero.errors import ConfigError


def test_window_score_is_the_next_token_nll_and_each_argmax() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 7)).astype(np.float32)
    ids = [1, 4, 0, 6, 2]
    nll, top1 = window_score(logits, ids)
    lp = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    assert nll == pytest.approx(-sum(lp[i, ids[i + 1]] for i in range(4)), rel=1e-12)
    assert top1 == [int(i) for i in logits.argmax(-1)]
    with pytest.raises(ConfigError, match="window of 4"):
        window_score(logits, ids[:4])


def test_perplexity_and_agreement_over_windows() -> None:
    ref = [[1, 2, 3], [4, 5]]
    got = score_windows([(2.0, [1, 2, 0]), (1.0, [4, 5])], ref)
    assert got["ppl"] == pytest.approx(math.exp(3.0 / 3)) and got["top1_agree_pct"] == pytest.approx(80.0)
    with pytest.raises(ConfigError, match="2 positions of a window of 3"):
        score_windows([(2.0, [1, 2]), (1.0, [4, 5])], ref)


def test_frontier_keeps_what_nothing_beats_on_both_axes() -> None:
    pts = {"float": (500.0, 0.0), "hetero": (2000.0, 0.2), "int8": (1800.0, 0.3), "q4": (1900.0, 5.0),
           "fast_bad": (2500.0, 9.0), "tie": (2000.0, 0.2)}
    beaten = dominated_by(pts)
    assert beaten["int8"] == ["hetero", "tie"] and beaten["q4"] == ["hetero", "tie"]
    assert beaten["hetero"] == [] and beaten["tie"] == []  # equal on both: neither beats the other
    assert beaten["float"] == [] and beaten["fast_bad"] == []


def _result(shared: bool, hetero_beaten: list[str]) -> dict:
    rows = [{"engine": "hetero_float", "ppl": 34.0, "delta_ppl_pct": 0.0, "top1_agree_pct": 100.0,
             "tokens_per_s": 500.0, "dominated_by": []},
            {"engine": "hetero", "ppl": 34.07, "delta_ppl_pct": 0.2, "top1_agree_pct": 94.4, "tokens_per_s": 2000.0,
             "dominated_by": hetero_beaten},
            {"engine": "llama_cpp_q4_0_fa", "ppl": 36.0, "delta_ppl_pct": 5.88, "top1_agree_pct": 80.0,
             "tokens_per_s": 1300.0, "dominated_by": ["hetero"]},
            {"engine": "ort_genai", "ppl": 35.0, "delta_ppl_pct": 2.94, "top1_agree_pct": 85.0}]  # not timed
    for r in rows:
        r.update(label=ENGINE_LABELS[r["engine"]], logits=HOW[r["engine"]])
    return {"conditions": {"model": "m", "threads": 2, "speed": "prefill of 1024 tokens, same run",
                           "shared_machine": shared,
                           "machine": "AMD EPYC 9R14 (Zen 4), 2 CPUs, a VM, avx512_vnni avx512_bf16, no AMX",
                           "loadavg_1m_start": 2.5, "loadavg_1m": 3.1, "date": "2026-12-07T06:00:00+00:00"},
            "eval": {"corpus": "austen:c3cbbd75bee4", "windows": 24, "window": 256, "positions": 6144},
            "warnings": [], "rows": rows, "frontier": ["hetero_float", *([] if hetero_beaten else ["hetero"])],
            "skipped": {"openvino_genai": "openvino-genai is not installed"}}


def test_table_names_the_cpu_the_shared_machine_and_the_frontier(tmp_path) -> None:
    md = markdown(_result(shared=True, hetero_beaten=[]))
    assert "AMD EPYC 9R14 (Zen 4)" in md and "avx512_vnni avx512_bf16, no AMX" in md
    assert "measured on a machine shared with other work" in md
    assert "| hetero | 2000 | 34.0700 | +0.20% | 94.4% | none: on the frontier |" in md
    assert "| llama_cpp_q4_0_fa | 1300 | 36.0000 | +5.88% | 80.0% | hetero |" in md
    assert "| ort_genai | – | 35.0000 | +2.94% | 85.0% | – |" in md
    assert "`hetero_float`, `hetero`. hetero's default lies on it" in md
    assert "Skipped: openvino_genai: openvino-genai is not installed" in md
    quiet = markdown(_result(shared=False, hetero_beaten=["llama_cpp_q4_0_fa"]))
    assert "shared" not in quiet and "hetero's default does not: `llama_cpp_q4_0_fa`" in quiet
    assert frontier_sentence({"rows": [], "frontier": []}) == "No engine was timed: no frontier."
    pytest.importorskip("matplotlib")
    plot(_result(shared=True, hetero_beaten=[]), tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_engine_says_how_its_logits_are_read() -> None:
    assert set(HOW) == set(ENGINE_LABELS) == {"hetero_float", "hetero", *PEERS}
