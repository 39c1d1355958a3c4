"""A served reply does not depend on what the prefix cache holds (`StoreConfig.exact`, the default): the same
question gets the same answer."""

from __future__ import annotations

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


@pytest.mark.slow
@pytest.mark.parametrize("segmented", [False, True])
def test_replies_are_the_same_cold_from_a_partial_prefix_and_after_a_flush(default_model, segmented, monkeypatch) -> None:
    """The default (INT8) method: the same prompt cold, again (all but its last token cached), after another prompt
    sharing a partial prefix, after a flush, and as a context's second turn against the same conversation sent cold:
    the same greedy tokens every time. Its prefill does not depend on the cut, so any cached prompt token is reused;
    `segmented`: the same runtime declared cut-dependent (as an NPU's kernels are until measured), so the service
    prefills in segments and reuses whole ones only."""
    from hetero.methods import make_runtime

    rt = make_runtime(default_model)
    if segmented:
        monkeypatch.setattr(rt.backend, "cut_invariant", False)
    book = _book(default_model, SEGMENT + 300)
    a, b = book[: SEGMENT + 120], book[: SEGMENT + 40] + book[SEGMENT + 200 :]  # share SEGMENT + 40 tokens
    with hetero.Service(rt, StoreConfig()) as service:
        assert service.segment == (SEGMENT if segmented else None)
        cold_a = service.complete(a, GREEDY)
        cold_b_first = service.complete(b, GREEDY)  # a partial hit: a's first SEGMENT + 40 tokens
        assert cold_b_first.usage.cached_tokens == (SEGMENT if segmented else SEGMENT + 40)
        again_a = service.complete(a, GREEDY)
        assert again_a.usage.cached_tokens == (SEGMENT if segmented else len(a) - 1)
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
        assert second.usage.cached_tokens >= SEGMENT  # the first turn's prompt; its reply's rows are prefilled again
    history = turns + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Shorter, please."}]
    with hetero.Service(rt, StoreConfig()) as cold:
        assert cold.chat(history, GREEDY).tokens == second.tokens
