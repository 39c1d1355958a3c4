"""The out-of-order executor inside `Runtime`: any policy gives bit-identical logits and caches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero.errors import ScheduleError
from hetero.runtime import Runtime
from hetero.sched.executor import OutOfOrderExecutor


@pytest.mark.parametrize("policy", ["in_order", "eq6", "rank", "chunk_first", "random"])
def test_policies_bit_identical(tiny_model, policy) -> None:
    ids = torch.arange(70) * 7 % tiny_model.config.vocab
    ref = Runtime(tiny_model, chunk=16).prefill(ids)
    rt = Runtime(tiny_model, chunk=16, executor=OutOfOrderExecutor(tiny_model.config.n_layers, 16, policy))
    try:
        r = rt.prefill(ids)
    finally:
        rt.close()
    assert np.array_equal(r.logits, ref.logits)
    assert np.array_equal(r.cache.k[:, :, :70], ref.cache.k[:, :, :70])
    assert np.array_equal(r.cache.v[:, :, :70], ref.cache.v[:, :, :70])
    assert r.schedule is not None and not r.schedule.simulated and len(r.chunk_ms) == 5


def test_failing_subgraph_stops_cleanly_and_runtime_stays_usable(tiny_model) -> None:
    rt = Runtime(tiny_model, chunk=16, executor=OutOfOrderExecutor(tiny_model.config.n_layers, 16, "rank"))
    ids = torch.arange(40) % 256
    good = rt.prefill(ids)
    real_o_ffn = rt.backend.o_ffn

    def broken(layer, a, h, out=None):
        if layer == 1:
            raise RuntimeError("simulated lane failure")
        return real_o_ffn(layer, a, h, out)

    rt.backend.o_ffn = broken
    cache = rt.new_cache()
    with pytest.raises(ScheduleError, match="o_ffn of chunk 0, layer 1.*simulated lane failure"):
        rt.prefill(ids, cache=cache)
    assert cache.length == 0  # the failed prefill did not advance the cache
    rt.backend.o_ffn = real_o_ffn
    again = rt.prefill(ids)
    rt.close()
    assert np.array_equal(again.logits, good.logits)


def test_one_chunk_runs_as_a_chain_on_the_calling_thread(tiny_model) -> None:
    """One chunk is a chain (Eq. 3): no lane hand-offs, the same numbers, errors still name the node."""
    ids = torch.arange(12) * 5 % tiny_model.config.vocab
    ref = Runtime(tiny_model, chunk=16).prefill(ids)
    rt = Runtime(tiny_model, chunk=16, executor=OutOfOrderExecutor(tiny_model.config.n_layers, 16, "rank",
                                                                   torch_threads=(1, 2)))
    before = torch.get_num_threads()
    try:
        r = rt.prefill(ids)
        assert np.array_equal(r.logits, ref.logits) and r.schedule.policy == "serial"
        assert torch.get_num_threads() == before

        def broken(layer, a, h, out=None):
            raise RuntimeError("lane failure")

        rt.backend.o_ffn = broken
        with pytest.raises(ScheduleError, match="o_ffn of chunk 0, layer 0.*lane failure"):
            rt.prefill(ids)
    finally:
        rt.close()
