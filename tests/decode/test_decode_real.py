"""Decoding the default model on hetero's cache: equal to HF greedy, speculation changes nothing greedy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero.decode import SamplingParams, generate, stream
from hetero.decode.step import DecodeStep
from hetero.errors import ConfigError
from hetero.runtime import Runtime

COPY_PROMPT = ("Repeat the following text exactly, word for word.\n\nIt is a truth universally acknowledged, that a "
               "single man in possession of a good fortune, must be in want of a wife.")


def chat_ids(model, text: str) -> list[int]:
    tok = model.tokenizer
    s = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(s, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def rt(default_model):
    """The float reference runtime (decoding it reads 540 MB a token: used for few tokens)."""
    return Runtime(default_model, chunk=64)


@pytest.fixture(scope="module")
def int8_rt(default_model, real_text_ids):
    """INT8 graphs on the CPU EP lane (a quick absmax plan: no calibration needed)."""
    from hetero.npu.graph_backend import NpuBackend
    from hetero.npu.quickplan import absmax_plan

    plan = absmax_plan(default_model, real_text_ids[:128])
    return Runtime(default_model, chunk=64, backend=NpuBackend(default_model, plan, 64, provider="cpu"))


def assert_same_or_numeric_tie(rt, ids, want, got) -> None:
    """Greedy outputs must match; a divergence is only tolerated at a numeric tie of the reference."""
    if list(want) == list(got):
        return
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
    assert i is not None, f"one output is a prefix of the other: {list(want)} vs {list(got)}"
    logits = rt.prefill(list(ids) + list(want[:i])).logits
    second, first = np.sort(logits)[-2:]
    assert float(first - second) < 1e-3, f"outputs diverge at token {i} where the margin is {float(first - second)}"


def test_greedy_equals_hf_generate(default_model, rt) -> None:
    from hetero.adapters.hf import generate as hf_generate, to_hf_model

    ids = chat_ids(default_model, "What is the capital of France?")
    g = generate(rt, rt.prefill(ids), SamplingParams(max_new_tokens=16))
    want = hf_generate(to_hf_model(default_model), torch.tensor(ids), rt.prefill(ids), 16)
    assert_same_or_numeric_tie(rt, ids, want, g.tokens)
    assert len(g.tokens) >= 8 and "Paris" in g.text


@pytest.fixture(scope="module")
def blocks_rt(default_model, int8_rt):
    """The same INT8 prefill with the decode placement of `make_runtime`: its steps of 1-8 rows on hetero's GEMVs over
    the GGUF's own Q4_1 / Q8_0 blocks (`decode.gguf_blocks`) where this CPU runs them."""
    from hetero.native import gemv
    from hetero.npu.placement import decode_placement

    why = gemv.unavailable(default_model.config)
    if why is not None:
        pytest.skip(f"hetero's GEMVs cannot run here: {why}")
    rt = Runtime(default_model, chunk=64, backend=int8_rt.backend, decode=decode_placement(int8_rt.backend))
    assert DecodeStep.of(rt).kernel == "blocks"
    return rt


@pytest.fixture(scope="module")
def gemv_rt(default_model, int8_rt, blocks_rt):
    """As `blocks_rt`, its steps on hetero's int8 GEMVs (`native.gemv`): the form of a model without those blocks."""
    import dataclasses

    rt = Runtime(default_model, chunk=64, backend=int8_rt.backend,
                 decode=dataclasses.replace(blocks_rt.decode, small_kernel="gemv"))
    assert DecodeStep.of(rt).kernel == "gemv"
    return rt


@pytest.mark.parametrize("speculate", ["lookup", "self", "draft"])
@pytest.mark.parametrize("form", ["int8", "gemv", "blocks"])
def test_speculation_is_token_for_token_plain_greedy(default_model, request, speculate, form) -> None:
    """Verifying a fixed deep tree emits plain greedy's tokens exactly (no tolerance for near-ties: a tree's rows are
    computed as one-row steps, bit for bit), on the INT8 graphs and on both forms of the GEMVs."""
    rt = request.getfixturevalue(f"{form}_rt")
    assert DecodeStep.of(rt).row_unexact() is None
    ids = chat_ids(default_model, COPY_PROMPT)
    params = SamplingParams(max_new_tokens=40 if speculate == "lookup" else 20)
    plain = generate(rt, rt.prefill(ids), params)
    r = rt.prefill(ids)
    # the draft model: the same INT8 model here (any runtime sharing the tokenizer works)
    # a fixed tree (depth 7 in 8 rows): the adaptive choice depends on measured timings
    spec = generate(rt, r, params, speculate=speculate, context_ids=ids,
                    draft_runtime=rt if speculate == "draft" else None, tree=(7, 8))
    assert list(spec.tokens) == list(plain.tokens)
    assert spec.drafted > 0 and spec.steps < len(spec.tokens) + 1
    assert r.cache.length == len(ids) + len(spec.tokens) - 1
    if speculate == "lookup":  # a copy task: many drafted tokens are right, fewer target passes
        assert spec.accepted >= 8 and spec.steps <= len(plain.tokens) - 8
    if speculate == "draft":  # the model drafting for itself: every drafted token is accepted
        assert spec.accepted == spec.drafted


def test_speculation_is_refused_where_tree_rows_are_not_one_row_steps(default_model, int8_rt) -> None:
    """ONNX Runtime's MatMulNBits steps (the small steps where hetero's GEMVs cannot run) compute a tree's rows
    otherwise than one-row steps: auto decodes without speculation there, and a drafter asked for is refused."""
    from hetero.npu.placement import decode_placement

    rt = Runtime(default_model, chunk=64, backend=int8_rt.backend, decode=decode_placement(int8_rt.backend))
    step = rt.owned("decode-step", lambda: DecodeStep(rt, kernel="nbits"))
    assert step is DecodeStep.of(rt) and "MatMulNBits" in step.row_unexact()
    ids = chat_ids(default_model, COPY_PROMPT)
    params = SamplingParams(max_new_tokens=6)
    for speculate in ("lookup", "self"):
        with pytest.raises(ConfigError, match=f"speculate='{speculate}' would change the greedy output"):
            generate(rt, rt.prefill(ids), params, speculate=speculate, context_ids=ids)
    auto = generate(rt, rt.prefill(ids), params, speculate="auto", context_ids=ids)
    assert auto.drafted == 0 and auto.tokens == generate(rt, rt.prefill(ids), params).tokens


def test_cache_continues_the_next_turn_without_reprefill(default_model, rt) -> None:
    ids = chat_ids(default_model, "Name a colour.")
    r = rt.prefill(ids)
    g = generate(rt, r, SamplingParams(max_new_tokens=4, stop_token_ids=()))
    assert g.cache is r.cache and r.cache.length == len(ids) + len(g.tokens) - 1
    more = [g.tokens[-1]] + default_model.tokenizer(" And another?")["input_ids"]
    cont = rt.prefill(more, cache=r.cache)
    fresh = rt.prefill(ids + list(g.tokens) + more[1:])
    np.testing.assert_allclose(cont.logits, fresh.logits, rtol=1e-3, atol=1e-3)


def test_closing_the_stream_early_keeps_the_cache_consistent(default_model, int8_rt) -> None:
    rt = int8_rt
    ids = chat_ids(default_model, COPY_PROMPT)
    r = rt.prefill(ids)
    it = stream(rt, r, SamplingParams(max_new_tokens=40), speculate="lookup", context_ids=ids)
    seen = [next(it) for _ in range(5)]
    it.close()
    assert [e.index for e in seen] == list(range(5))
    assert len(ids) <= r.cache.length <= len(ids) + 40
    assert r.cache.length == len(ids) + len(seen) - 1 or r.cache.length >= len(ids) + 4


def test_stop_string_and_streamed_text(default_model, int8_rt) -> None:
    rt = int8_rt
    ids = chat_ids(default_model, COPY_PROMPT)
    full = generate(rt, rt.prefill(ids), SamplingParams(max_new_tokens=30))
    assert "possession" in full.text
    r = rt.prefill(ids)
    events = list(stream(rt, r, SamplingParams(max_new_tokens=30, stop=("possession",))))
    text = "".join(e.text for e in events)
    assert text == full.text[: full.text.index("possession")]
    assert r.cache.length == len(ids) + len(events) - 1


def test_seeded_sampling_is_reproducible_and_the_same_with_speculation(default_model, int8_rt) -> None:
    rt = int8_rt
    ids = chat_ids(default_model, COPY_PROMPT)
    p = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=50, seed=3)
    a = generate(rt, rt.prefill(ids), p)
    b = generate(rt, rt.prefill(ids), p)
    assert a.tokens == b.tokens
    c = generate(rt, rt.prefill(ids), p, speculate="lookup", context_ids=ids, tree=(3, 4))
    assert c.drafted > 0 and c.tokens == a.tokens  # each position's token is drawn with that position's uniform


def test_bad_speculate_and_context(default_model, int8_rt) -> None:
    rt = int8_rt
    ids = chat_ids(default_model, "Hi")
    with pytest.raises(ConfigError, match="speculate"):
        generate(rt, rt.prefill(ids), SamplingParams(max_new_tokens=2), speculate="magic")
    with pytest.raises(ConfigError, match="context_ids"):
        generate(rt, rt.prefill(ids), SamplingParams(max_new_tokens=2), context_ids=ids[:-1])
    with pytest.raises(ConfigError, match="draft"):
        generate(rt, rt.prefill(ids), SamplingParams(max_new_tokens=2), speculate="draft")
