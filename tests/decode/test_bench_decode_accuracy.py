"""`bench.decode_accuracy` scores the tokens a decode step predicts, one token a step, and renders its tables;
no accuracy thresholds here (bench/)."""

from __future__ import annotations

import math

import pytest
import torch

from bench.decode_accuracy import _row, greedy, markdown, prefix_equal, teacher_forced
from hetero.decode.step import DecodeStep
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model


@pytest.fixture(autouse=True)
def graph_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))


def test_teacher_forced_scores_each_decoded_token_as_the_reference_forward_does():
    m = make_tiny_model()
    rt = Runtime(m, chunk=16)
    window = [int(t) for t in torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0))]
    nll, top = teacher_forced(rt, DecodeStep(rt), window, 8)
    assert len(nll) == len(top) == 20 - 8 - 1  # tokens 9..19, each predicted by a one-row step
    from hetero import model as ref

    logits, _, _ = ref.forward(m.config, m.weights, torch.tensor(window))
    want = [float(-torch.log_softmax(logits[i], -1)[window[i + 1]]) for i in range(8, 19)]
    assert nll == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert top == [int(logits[i].argmax()) for i in range(8, 19)]
    assert greedy(rt, DecodeStep(rt), window[:8], 3)[0] == int(logits[7].argmax())


def test_rows_and_markdown():
    nll = {"float": [1.0, 2.0], "int8": [1.5, 2.0], "nbits": [1.0, 2.1]}
    agree = {"float": [True, True], "int8": [True, False], "nbits": [True, True]}
    row = _row(nll, agree)
    assert row["ppl"]["float"] == pytest.approx(math.exp(1.5)) and row["top1"]["int8"] == 0.5
    assert row["delta_pct"]["float"] == 0.0 and row["delta_pct"]["int8"] > 0
    r = {"model": "tiny", "forms": ["float", "int8", "nbits"], "texts": {"t": row}, "all": row, "windows": 1,
         "length": 3, "prefix": 1, "scored_per_text": 2, "greedy": {"p": {"int8": 1, "nbits": 2}}, "greedy_tokens": 2,
         "cpu": {}, "note": "", "command": "c"}
    md = markdown(r)
    assert "| t | " in md and "| all | " in md and "| p | 1 | 2 |" in md
    assert prefix_equal([1, 2, 3], [1, 2, 4]) == 2 and prefix_equal([1, 2], [1, 2]) == 2


def test_a_float_copy_holds_the_files_weights_dequantized(tmp_path):
    """`--float-copy`: the same model (config, every weight the loader reads, bit for bit) with every tensor in F32,
    written once, so the made decode forms have float tensors to round."""
    from bench.decode_accuracy import float_copy
    from hetero.loader import load_model
    from hetero.native.gguf_forms import gguf_table
    from tests.gguf_writer import write_gguf

    qtypes = {**{f: "Q4_1" for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}, "": "Q8_0"}
    src = write_gguf(make_tiny_model(), tmp_path / "q.gguf", qtypes)
    out = float_copy(src, tmp_path / "copy" / "q.f32.gguf")
    assert {t.type for t in gguf_table(out).tensors.values()} == {0} and list(out.parent.iterdir()) == [out]
    a, b = load_model(src), load_model(out)
    assert a.config == b.config and a.fingerprint != b.fingerprint
    for name, arr in a.arrays().items():
        torch.testing.assert_close(torch.from_numpy(b.arrays()[name]), torch.from_numpy(arr), rtol=0, atol=0)
    assert float_copy(src, out) == out  # written once
