"""A runtime owns its decode step (closed with it), and threads that share a runtime decode in turn."""

from __future__ import annotations

import threading

import numpy as np

from hetero.decode.step import DecodeStep
from hetero.decode.tree import TokenTree
from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model
from tests.npu.conftest import tiny_plan


def _runtime(tmp_path, monkeypatch) -> Runtime:
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    m = make_tiny_model()
    return Runtime(m, chunk=16, backend=NpuBackend(m, tiny_plan(m), 16, provider="cpu",
                                                   options=GraphOptions(intra_op_threads=1)))


def test_the_runtime_owns_its_step_and_closing_it_stops_the_helper(tmp_path, monkeypatch):
    rt = _runtime(tmp_path, monkeypatch)
    step = DecodeStep.of(rt)
    assert DecodeStep.of(rt) is step
    step.forward(rt.prefill(np.arange(1, 10)).cache, TokenTree([3], [-1]))
    helper = step.pool._thread if step.pool is not None else None
    rt.close()
    assert helper is None or not helper.is_alive()
    assert DecodeStep.of(rt) is not step  # a closed runtime's next step is a new one


def test_threads_sharing_a_step_get_the_one_thread_results(tmp_path, monkeypatch):
    rt = _runtime(tmp_path, monkeypatch)
    step = DecodeStep(rt, attention_threads=1)
    prompt = np.arange(1, 30) % 200
    caches = [rt.prefill(prompt).cache for _ in range(4)]
    want = step.forward(rt.prefill(prompt).cache, TokenTree([7, 9], [-1, 0]))
    got: list[np.ndarray | None] = [None] * 4
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(5):
                got[i] = step.forward(caches[i], TokenTree([7, 9], [-1, 0]))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(np.array_equal(g, want) for g in got)
    rt.close()
