"""A warm start does no decode set-up work it did before: the decode sizes share the prefill's sessions,
step costs are stored per host and read back, and the graphs split over both cores only once a decode is long."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from hetero.decode import stepcosts
from hetero.decode.step import DecodeStep
from hetero.decode.tree import TokenTree
from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model
from tests.npu.conftest import tiny_plan


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    m = make_tiny_model()
    rt = Runtime(m, chunk=16, backend=NpuBackend(m, tiny_plan(m), 16, provider="cpu",
                                                 options=GraphOptions(intra_op_threads=1)))
    yield rt
    rt.close()


def test_decode_sizes_share_the_prefill_sessions(runtime):
    be = runtime.backend
    assert be.any_rows
    assert all(be.at_chunk(c, 1) is be for c in (1, 2, 4, 8))
    other = be.at_chunk(4, 2)  # another thread count: its own sessions, the same graphs
    assert other is not be and other.program(0).runs[0].source == be.program(0).runs[0].source


def test_step_costs_are_measured_once_per_host_and_read_back(runtime, monkeypatch):
    cache = runtime.prefill(np.arange(1, 20)).cache
    first = DecodeStep(runtime, attention_threads=1)
    costs = dict(first.measure(cache))
    assert sorted(costs) == [1, 2, 4, 8] and all(ms > 0 for ms in costs.values())
    assert stepcosts.costs_path(first.costs_key).is_file()
    second = DecodeStep(runtime, attention_threads=1)
    monkeypatch.setattr(second, "forward", lambda *a, **k: pytest.fail("measured again"))
    assert second.measure(cache) == pytest.approx(costs, abs=1e-3)


def test_a_damaged_cost_record_is_measured_again(runtime, caplog):
    cache = runtime.prefill(np.arange(1, 20)).cache
    step = DecodeStep(runtime, attention_threads=1)
    path = stepcosts.costs_path(step.costs_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": stepcosts.FORMAT, "key": step.costs_key, "step_ms": {"1": "nan"}}))
    with caplog.at_level(logging.WARNING):
        costs = step.measure(cache, sizes=(1,))
    assert "ignoring stored decode step costs" in caplog.text and costs[1] > 0
    assert json.loads(path.read_text())["step_ms"]["1"] == pytest.approx(costs[1], abs=1e-3)


def test_the_graphs_split_over_both_cores_after_split_after_one_row_steps(runtime):
    step = DecodeStep(runtime, attention_threads=2, split_after=2)
    cache = runtime.prefill(np.arange(1, 20)).cache
    logits = []
    for _ in range(3):
        logits.append(step.forward(cache, TokenTree([5], [-1])))
        split = step._bound[1].stages is not None
        assert split == (step.one_row_steps > 2)
    assert step.one_row_steps == 3 and split
    # the same K/V row each time: the split step's logits are the whole graphs' bit for bit
    assert np.array_equal(logits[0], logits[2]) and np.array_equal(logits[1], logits[2])
