"""A prompt's prefill is the same, bit for bit, however it was cut: cold, continued from a cached prefix
(one cut or two), or run with another chunk length. What lets serve reuse any cached prompt token exactly
(`serve.store.cut_invariant`). The BF16 attention kernel once smoothed K/V by their mean over the chunk's keys, which
tied every row to where its chunk ended: logits moved by up to ~1 between a cold and a continued prefill; and
GroupQueryAttention runs one row through its token-generation path, which sums in another order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hetero.methods import make_runtime
from hetero.serve.store import cut_invariant

TEXT = Path(__file__).parent / "data" / "sample.txt"


def _same(a, b, n: int) -> bool:
    return (np.array_equal(a.logits, b.logits) and np.array_equal(a.cache.k[:, :, :n], b.cache.k[:, :, :n])
            and np.array_equal(a.cache.v[:, :, :n], b.cache.v[:, :, :n]))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["hetero", "hetero-gqa", "hetero-lanes", "float"])
def test_a_prefill_does_not_depend_on_where_the_prompt_was_cut(default_model, method) -> None:
    rt = make_runtime(default_model, method)
    assert cut_invariant(rt)
    ids = default_model.tokenizer(TEXT.read_text())["input_ids"][:700]
    cold = rt.prefill(ids)
    for cuts in ([1], [17], [256], [300, 301], [40, 512], [699]):  # a one-token piece: GroupQueryAttention's other path
        cache = None
        for a, b in zip([0] + cuts, cuts + [len(ids)]):
            part = rt.prefill(ids[a:b], cache=cache)
            cache = part.cache
        assert _same(part, cold, len(ids)), (method, cuts)
    if method == "hetero":  # the wavefront's chunks follow the chunk length: any length gives the same numbers
        other = make_runtime(default_model, method, chunk=64)
        assert _same(other.prefill(ids), cold, len(ids))
        other.close()
    rt.close()


def test_a_runtime_whose_attention_runs_in_torch_is_not_declared_cut_invariant() -> None:
    """torch's attention (heads ONNX Runtime's kernel cannot rotate: a partial rotary width of 8) picks its blocks by
    the sequence lengths, so serve prefills such a runtime in segments (`serve.store.SEGMENT`)."""
    import dataclasses

    from hetero.runtime import Runtime
    from tests.conftest import make_tiny_model

    model = make_tiny_model()
    assert cut_invariant(Runtime(model, chunk=16))
    partial = dataclasses.replace(model, config=dataclasses.replace(model.config, rotary_dim=8))
    assert not cut_invariant(Runtime(partial, chunk=16))
