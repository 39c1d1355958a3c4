"""A served reply does not depend on what the prefix cache holds (`StoreConfig.exact`, the default; issue 40)."""

from __future__ import annotations

import numpy as np
import pytest

import hetero
from hetero.decode import SamplingParams
from hetero.serve import StoreConfig
from hetero.serve.store import SEGMENT, exact_end, segment_cuts

GREEDY = SamplingParams(max_new_tokens=8)


def _book(model, n: int) -> list[int]:
    from pathlib import Path

    text = (Path(__file__).parents[1] / "data" / "sample.txt").read_text()
    return model.tokenizer(text)["input_ids"][:n]


def test_segments_fall_on_multiples_of_the_segment() -> None:
    assert segment_cuts(0, 2 * SEGMENT + 76, SEGMENT) == [SEGMENT, 2 * SEGMENT, 2 * SEGMENT + 76]
    assert segment_cuts(SEGMENT + 88, SEGMENT, SEGMENT) == [SEGMENT - 88, SEGMENT]
    assert segment_cuts(40, 1000, None) == [1000]
    assert exact_end(SEGMENT + 5, SEGMENT) == SEGMENT and exact_end(SEGMENT - 1, SEGMENT) == 0
    assert exact_end(37, None) == 37


def test_the_float_prefill_is_the_same_wherever_a_prompt_is_cut(default_model) -> None:
    """What lets the float reference reuse any cached prompt token exactly (`store.cut_invariant`)."""
    rt = hetero.Runtime(default_model, chunk=32)
    ids = _book(default_model, 300)
    cold = rt.prefill(ids)
    for cut in (1, 31, 77, 256):
        part = rt.prefill(ids[:cut])
        rest = rt.prefill(ids[cut:], cache=part.cache)
        assert np.array_equal(rest.logits, cold.logits), cut
        assert np.array_equal(rest.cache.k[:, :, :300], cold.cache.k[:, :, :300]), cut


@pytest.mark.slow
def test_default_method_replies_are_the_same_cold_from_a_partial_prefix_and_after_a_flush(default_model) -> None:
    """The default (INT8) method, whose prefill depends on where a prompt is cut: the same prompt cold, again (its
    whole segments cached), after another prompt sharing a partial prefix, after a flush, and as a context's second
    turn against the same conversation sent cold: the same greedy tokens every time."""
    from hetero.methods import make_runtime

    rt = make_runtime(default_model)
    book = _book(default_model, SEGMENT + 300)
    a, b = book[: SEGMENT + 120], book[: SEGMENT + 40] + book[SEGMENT + 200 :]  # share SEGMENT + 40 tokens
    with hetero.Service(rt, StoreConfig()) as service:
        assert service.segment == SEGMENT
        cold_a = service.complete(a, GREEDY)
        cold_b_first = service.complete(b, GREEDY)  # a partial hit: a's first segment
        assert cold_b_first.usage.cached_tokens == SEGMENT
        again_a = service.complete(a, GREEDY)
        service.flush()
        flushed_a = service.complete(a, GREEDY)
        assert cold_a.tokens == again_a.tokens == flushed_a.tokens
    with hetero.Service(rt, StoreConfig()) as fresh:
        assert fresh.complete(b, GREEDY).tokens == cold_b_first.tokens  # b cold, in a service that never saw a
    text = default_model.tokenizer.decode(book[:SEGMENT + 60])
    turns = [{"role": "user", "content": "Summarize this:\n" + text}]
    with hetero.Service(rt, StoreConfig()) as service:
        cid = service.create_context()
        first = service.chat(turns, GREEDY, cid)
        second = service.chat([{"role": "user", "content": "Shorter, please."}], GREEDY, cid)
        assert second.usage.cached_tokens >= SEGMENT
    history = turns + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Shorter, please."}]
    with hetero.Service(rt, StoreConfig()) as cold:
        assert cold.chat(history, GREEDY).tokens == second.tokens
