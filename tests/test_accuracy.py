"""The quantized default answers like float, checked without luck, for every weight form.

No greedy answer of the quantized path is asserted where float itself hesitates (the README demo's first
token is a near-tie in float: 'The' 0.152 vs 'L' 0.140). Instead: on chat prompts with a float-like
answer, wherever float's top-1 leads its runner-up by > MARGIN, the quantized top-1 must equal float's and
lead every other token by >= SLACK, so that a pass here is not one float rounding away from a failure on
another CPU; perplexity on a short real text stays within a bound. Each weight form is forced (`isa`): this CPU's
default and the AVX2 one; the VNNI form is only exact with VNNI (`tests/npu/test_export.py`).
"""

from __future__ import annotations

import math

import pytest
import torch

from hetero import model as ref
from hetero.methods import quant_setup
from hetero.npu import isa
from hetero.npu.graph_backend import NpuBackend
from hetero.outliers.calibration import token_windows
from hetero.outliers.corpus import load_corpus

C = 64  # every (prompt + answer) below fits one chunk: the graphs then run the whole sequence at once
QA = [  # (question, an answer; only the positions where float is sure are checked)
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    # after "7 * 8 is 5" float says '6' (0.68 vs '4' 0.32): mllm-NPU's W8A8 plan without rotation said '4'
    ("What is 7 times 8?", "7 * 8 is 56."),
    ("What is the largest planet in the solar system?", "The largest planet in the solar system is Jupiter."),
]
# float's top-1 probability minus its runner-up's. At 0.1 the check passed by luck: after "7 * 8 is" float leads
# ' ' over ' equal' by 0.142, INT8 by 0.028 here (AMD EPYC Zen 4), and another CI machine's float kernels flipped it
MARGIN = 0.2
# the quantized top-1's least lead where checked. Measured here: 0.11 ('6' over '4' after "7 * 8 is 5"); torch's
# scalar kernels instead of AVX-512 (ATEN_CPU_CAPABILITY=default) move these leads by up to 0.045
SLACK = 0.05
PPL_BOUND = 1.03  # quantized / float perplexity on 4 x 64 tokens of Austen (measured 1.0095, rotated default)

FORMS = sorted({isa.default_weight_form(), isa.FORM_AVX2})


_BACKENDS: dict[str, NpuBackend] = {}


def _backend(model, form: str) -> tuple:
    """(the model the default method quantizes, its INT8 graphs at C) for a forced weight form."""
    if form not in _BACKENDS:
        qm, plan = quant_setup(model, "cpu", weight_form=form)
        _BACKENDS[form] = qm, NpuBackend(qm, plan, chunk=C)
    return _BACKENDS[form]


def _chat(model, question: str, answer: str) -> tuple[int, torch.Tensor]:
    """(prompt length, prompt + answer ids) with the model's chat template."""
    tok = model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    ids = prompt + tok(answer, add_special_tokens=False)["input_ids"]
    assert len(ids) <= C
    return len(prompt), torch.tensor(ids)


def _onnx_logits(model, form: str, ids: torch.Tensor) -> torch.Tensor:
    """Logits of every position through the INT8 graphs (padding after the sequence cannot reach it)."""
    qm, be = _backend(model, form)
    pad = torch.cat([ids, torch.zeros(be.chunk - ids.numel(), dtype=ids.dtype)])
    return ref.forward(qm.config, qm.weights, pad, be)[0][: ids.numel()]


@pytest.mark.slow
@pytest.mark.parametrize("question, answer", QA)
@pytest.mark.parametrize("form", FORMS)
def test_quantized_top1_equals_float_where_float_is_sure(default_model, form, question, answer):
    m = default_model
    n_prompt, ids = _chat(m, question, answer)
    top2 = ref.forward(m.config, m.weights, ids)[0].double().softmax(-1).topk(2, -1)
    sure = (top2.values[:, 0] - top2.values[:, 1] > MARGIN)[n_prompt - 1:]  # the answer's positions
    probs = _onnx_logits(m, form, ids).double().softmax(-1)[n_prompt - 1:]
    got = probs.argmax(-1)
    want = top2.indices[n_prompt - 1:, 0]
    assert int(sure.sum()) >= 4  # most answer tokens are sure in float ("Paris", "Tokyo", "56" among them)
    assert torch.equal(got[sure], want[sure]), (form, m.tokenizer.decode(got))
    lead = probs.topk(2, -1).values.diff(dim=-1).neg()[:, 0]  # the quantized top-1 minus its runner-up
    assert float(lead[sure].min()) >= SLACK, (form, lead[sure].tolist())


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_perplexity_bound_on_a_short_text(default_model, form):
    m = default_model
    wins = token_windows(m.tokenizer, load_corpus("austen"), 4 * C, C)  # C tokens each: one graph run

    def nll(ids: torch.Tensor, logits: torch.Tensor) -> float:
        return float(-torch.log_softmax(logits[:-1].double(), -1).gather(1, ids[1:, None]).sum())

    d = sum(nll(ids, _onnx_logits(m, form, ids)) - nll(ids, ref.forward(m.config, m.weights, ids)[0]) for ids in wins)
    ratio = math.exp(d / sum(ids.numel() - 1 for ids in wins))
    print(f"{form}: quantized / float perplexity {ratio:.4f}")
    assert ratio <= PPL_BOUND, (form, ratio)


def test_a_rotating_recipe_needs_the_rotated_model():
    from hetero.errors import ConfigError
    from hetero.methods import ROT_A16_DOWN, W8A8, quant_plan
    from hetero.outliers.rotate import rotate_model
    from tests.conftest import make_tiny_model

    tiny = make_tiny_model()
    with pytest.raises(ConfigError, match="quant_setup"):
        quant_plan(tiny, recipe=ROT_A16_DOWN)
    with pytest.raises(ConfigError, match="quant_setup"):
        quant_plan(rotate_model(tiny, cache=False), recipe=W8A8)
