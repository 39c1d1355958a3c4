"""A prefill as plan → execute → commit: frozen typed results, one executor interface, buffers made once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

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
    ex = SerialExecutor(tiny_model.config.n_layers)
    dag = ex.compile(2)
    seen: list[int] = []
    s = ex.execute(dag, seen.append)
    assert seen == list(range(dag.n_nodes))
    check_schedule(s)
    assert list(s.start_us) == sorted(s.start_us)


def test_chunk_buffers_are_allocated_once_per_runtime(tiny_model) -> None:
    rt = Runtime(tiny_model, chunk=16)
    rt.prefill(torch.arange(40) % 256)
    ptrs = [b.data_ptr() for pair in rt.buffers.h for b in pair] + [q.data_ptr() for q in rt.buffers.qkv]
    assert len(rt.buffers.h) == 3
    first = rt.prefill(torch.arange(20) % 256)  # fewer chunks: the same buffers, none added
    again = [b.data_ptr() for pair in rt.buffers.h for b in pair] + [q.data_ptr() for q in rt.buffers.qkv]
    assert again == ptrs
    second = rt.prefill(torch.arange(20) % 256)
    assert torch.equal(first.logits, second.logits)  # buffers reused, results unchanged


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
    assert all(torch.equal(g, w) for g, w in zip(got, want))
