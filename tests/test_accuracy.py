"""The quantized default answers like float, checked without luck (issue 10, for every weight form).

No greedy answer of the quantized path is asserted where float itself hesitates (the README demo's first
token is a near-tie in float: 'The' 0.152 vs 'L' 0.140). Instead: on chat prompts with a float-like
answer, the quantized top-1 must equal float's wherever float's top-1 leads its runner-up by > 0.1;
perplexity on a short real text stays within a bound. Each weight form is forced (`isa`): this CPU's
default and the AVX2 one; the VNNI form is only exact with VNNI (`tests/npu/test_export.py`).
"""

from __future__ import annotations

import math

import pytest
import torch

from hetero import model as ref
from hetero.methods import quant_plan
from hetero.npu import isa
from hetero.npu.backend import NpuBackend
from hetero.outliers.calibrate import token_windows
from hetero.outliers.corpus import load_corpus

C = 64  # every (prompt + answer) below fits one chunk: the graphs then run the whole sequence at once
# Known gap of the W8A8 plan without rotation or A16 (issue 10): after "7 * 8 is 5" float says '6' (0.68
# vs '4' 0.32), the INT8 graphs and the torch INT8 reference both say '4' (0.88). Strict: an XPASS fails.
_KNOWN_GAP = pytest.mark.xfail(strict=True, reason="W8A8 without rotation/A16 flips 7*8 = 56 to 54")
QA = [  # (question, an answer; only the positions where float is sure are checked)
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    pytest.param("What is 7 times 8?", "7 * 8 is 56.", marks=_KNOWN_GAP),
    ("What is the largest planet in the solar system?", "The largest planet in the solar system is Jupiter."),
]
MARGIN = 0.1  # float's top-1 probability minus its runner-up's
PPL_BOUND = 1.05  # quantized / float perplexity on 4 x 64 tokens of Austen

FORMS = sorted({isa.default_weight_form(), isa.FORM_AVX2})


_BACKENDS: dict[str, NpuBackend] = {}


def _backend(model, form: str) -> NpuBackend:
    if form not in _BACKENDS:
        _BACKENDS[form] = NpuBackend(model, quant_plan(model, "cpu", weight_form=form), chunk=C)
    return _BACKENDS[form]


def _chat(model, question: str, answer: str) -> tuple[int, torch.Tensor]:
    """(prompt length, prompt + answer ids) with the model's chat template."""
    tok = model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    ids = prompt + tok(answer, add_special_tokens=False)["input_ids"]
    assert len(ids) <= C
    return len(prompt), torch.tensor(ids)


def _onnx_logits(model, be: NpuBackend, ids: torch.Tensor) -> torch.Tensor:
    """Logits of every position through the INT8 graphs (padding after the sequence cannot reach it)."""
    pad = torch.cat([ids, torch.zeros(be.chunk - ids.numel(), dtype=ids.dtype)])
    return ref.forward(model.config, model.weights, pad, be)[0][: ids.numel()]


@pytest.mark.slow
@pytest.mark.parametrize("question, answer", QA)
@pytest.mark.parametrize("form", FORMS)
def test_quantized_top1_equals_float_where_float_is_sure(default_model, form, question, answer):
    m = default_model
    n_prompt, ids = _chat(m, question, answer)
    top2 = ref.forward(m.config, m.weights, ids)[0].double().softmax(-1).topk(2, -1)
    sure = (top2.values[:, 0] - top2.values[:, 1] > MARGIN)[n_prompt - 1:]  # the answer's positions
    got = _onnx_logits(m, _backend(m, form), ids).argmax(-1)[n_prompt - 1:]
    want = top2.indices[n_prompt - 1:, 0]
    assert int(sure.sum()) >= 4  # most answer tokens are sure in float ("Paris", "Tokyo", "56" among them)
    assert torch.equal(got[sure], want[sure]), (form, m.tokenizer.decode(got))


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_perplexity_bound_on_a_short_text(default_model, form):
    m = default_model
    wins = token_windows(m.tokenizer, load_corpus("austen"), 4 * C, C)  # C tokens each: one graph run

    def nll(ids: torch.Tensor, logits: torch.Tensor) -> float:
        return float(-torch.log_softmax(logits[:-1].double(), -1).gather(1, ids[1:, None]).sum())

    be = _backend(m, form)
    d = sum(nll(ids, ref.forward(m.config, m.weights, ids, be)[0]) - nll(ids, ref.forward(m.config, m.weights, ids)[0])
            for ids in wins)
    ratio = math.exp(d / sum(ids.numel() - 1 for ids in wins))
    assert ratio <= PPL_BOUND, (form, ratio)
