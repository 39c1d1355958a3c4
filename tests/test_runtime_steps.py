"""A prefill as plan → execute → commit: frozen typed results, one executor interface, buffers made once."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hetero.nodes import DEFAULT_PLACEMENT, reads_kv
from hetero.runtime import PrefillPlan, Runtime, SerialExecutor
from hetero.schedule import Schedule, check_schedule


def test_result_and_plan_are_frozen_and_typed(tiny_model) -> None:
    rt = Runtime(tiny_model, chunk=16)
    plan = rt.plan(torch.arange(40) % 256)
    assert isinstance(plan, PrefillPlan) and len(plan.chunks) == 3
    assert plan.dag.n_nodes == 3 * tiny_model.config.n_layers * 3
    r = rt.prefill(torch.arange(40) % 256)
    assert isinstance(r.schedule, Schedule) and r.schedule.policy == "serial" and not r.schedule.simulated
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.n_tokens = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.start = 3  # type: ignore[misc]


def test_serial_executor_runs_program_order(tiny_model) -> None:
    ex = SerialExecutor(tiny_model.config.n_layers, DEFAULT_PLACEMENT)
    dag = ex.compile(2, reads_kv(DEFAULT_PLACEMENT))
    seen: list[int] = []
    s = ex.execute(dag, seen.append)
    assert seen == list(range(dag.n_nodes))
    check_schedule(s)
    assert list(s.start_us) == sorted(s.start_us)


def test_chunk_buffers_are_allocated_once_per_runtime(tiny_model) -> None:
    rt = Runtime(tiny_model, chunk=16)
    rt.executor.chunks_in_flight = None  # a buffer set per chunk (an executor that may run any ready node)
    rt.prefill(torch.arange(40) % 256)
    ptrs = [b.ctypes.data for pair in rt.buffers.h for b in pair] + [q.ctypes.data for q in rt.buffers.qkv]
    assert len(rt.buffers.h) == 3
    first = rt.prefill(torch.arange(20) % 256)  # fewer chunks: the same buffers, none added
    again = [b.ctypes.data for pair in rt.buffers.h for b in pair] + [q.ctypes.data for q in rt.buffers.qkv]
    assert again == ptrs
    second = rt.prefill(torch.arange(20) % 256)
    assert np.array_equal(first.logits, second.logits)  # buffers reused, results unchanged


def test_chunk_buffers_are_sized_by_the_chunks_in_flight_not_the_prompt(tiny_model) -> None:
    """In program order one chunk runs at a time: one buffer set serves every chunk of any prompt, with the results,
    bit for bit, of a set per chunk."""
    rt = Runtime(tiny_model, chunk=16)
    ids = torch.arange(100) * 7 % 256
    shared = rt.prefill(ids)
    assert len(rt.buffers.h) == len(rt.buffers.qkv) == len(rt.buffers.attn) == 1  # 7 chunks
    rt.executor.chunks_in_flight = None
    own = rt.prefill(ids)
    assert len(rt.buffers.h) == 7
    assert np.array_equal(shared.logits, own.logits)
    assert np.array_equal(shared.cache.k[:, :, :100], own.cache.k[:, :, :100])


def test_concurrent_prefills_share_buffers_safely(tiny_model) -> None:
    """Callers on several threads (a service) get the same results as one at a time."""
    import threading

    rt = Runtime(tiny_model, chunk=16)
    prompts = [torch.arange(n) * 3 % 256 for n in (40, 23, 50, 17)]
    want = [rt.prefill(p).logits for p in prompts]
    got: list[torch.Tensor | None] = [None] * len(prompts)

    def work(k: int) -> None:
        got[k] = rt.prefill(prompts[k]).logits

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def _drive(steps) -> object:
    n = 0
    while True:
        try:
            next(steps)
            n += 1
        except StopIteration as done:
            return done.value, n


@pytest.mark.parametrize("ooo", [False, True])
def test_a_plan_stepped_in_slices_equals_one_run(tiny_model, ooo: bool) -> None:
    """prefill_steps with a tiny slice yields between waves and still writes the same K/V and logits; two
    plans interleaved slice by slice (each with its own buffers) both stay exact."""
    from hetero.sched.executor import OutOfOrderExecutor

    ex = OutOfOrderExecutor(tiny_model.config.n_layers, 16, "rank") if ooo else None
    rt = Runtime(tiny_model, chunk=16, executor=ex)
    a, b = torch.arange(70) * 7 % 256, torch.arange(45) * 5 % 256
    want_a, want_b = rt.prefill(a), rt.prefill(b)
    got, slices = _drive(rt.prefill_steps(a, slice_s=0.0))
    assert slices >= 2  # resumed between waves, not run in one go
    assert np.array_equal(got.logits, want_a.logits) and got.cache.length == 70
    assert np.array_equal(got.cache.k[:, :, :70], want_a.cache.k[:, :, :70])
    check_schedule(got.schedule)
    ga, gb = rt.prefill_steps(a, slice_s=0.0), rt.prefill_steps(b, slice_s=0.0)
    out: dict = {}
    while len(out) < 2:
        for name, g in (("a", ga), ("b", gb)):
            if name in out:
                continue
            try:
                next(g)
            except StopIteration as done:
                out[name] = done.value
    assert np.array_equal(out["a"].logits, want_a.logits) and np.array_equal(out["b"].logits, want_b.logits)
    rt.close()


def test_a_closed_plan_leaves_the_cache(tiny_model) -> None:
    rt = Runtime(tiny_model, chunk=16)
    first = rt.prefill(torch.arange(20) % 256)
    steps = rt.prefill_steps(torch.arange(50) % 256, cache=first.cache, slice_s=0.0)
    next(steps)
    steps.close()
    assert first.cache.length == 20
    again = rt.prefill(torch.arange(50) % 256, cache=first.cache)
    assert again.start == 20 and again.cache.length == 70


def test_an_uncontended_plan_runs_without_pausing(tiny_model) -> None:
    rt = Runtime(tiny_model, chunk=16)
    asked: list[bool] = []

    def contended() -> bool:
        asked.append(True)
        return False

    got, slices = _drive(rt.prefill_steps(torch.arange(70) % 256, slice_s=0.0, contended=contended))
    assert slices == 0 and asked and np.array_equal(got.logits, rt.prefill(torch.arange(70) % 256).logits)
