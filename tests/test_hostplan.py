"""`hetero.hostplan`: one frozen plan of how a runtime runs on this host, resolved at the edge (`methods.host_plan`),
printed by `hetero info`, and taken as decided by the runtime, its backend, executor and decode step."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import hetero.methods as methods
from hetero.chunking import OVERSIZE, ChunkRule
from hetero.cli import main
from hetero.errors import ConfigError
from hetero.hostplan import Choice, HostPlan
from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.npu.nodes import HALF_PLACEMENT, LAYER_PLACEMENT
from hetero.runtime import Runtime, SerialExecutor
from hetero.sched.executor import OutOfOrderExecutor
from hetero.sched.wavefront import WavefrontExecutor
from tests.conftest import make_tiny_model
from tests.gguf_writer import write_gguf
from tests.npu.conftest import tiny_plan

DECISIONS = ("method", "chunks", "layout", "npu", "executor", "attention", "glue", "weights", "decode", "threads")


@pytest.fixture
def quantized(monkeypatch, tmp_path):
    """A model the default method runs on two cores (head_dim 32: the BF16 kernel takes it), with a quantization plan
    made here instead of calibrated (rotated at down_in, as the default recipe's); graphs in a cache of its own."""
    from tests.npu.test_ort_ops import _rotated

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(methods, "quant_plan", lambda model, *a, **k: _rotated(model))
    monkeypatch.setattr(methods, "quant_model", lambda model, recipe: model)
    return make_tiny_model(head_dim=32)


def test_the_plan_is_frozen_and_every_decision_has_a_reason(quantized):
    plan = methods.host_plan(quantized, "hetero", chunk=16, threads=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.attention = Choice("gqa", "changed later")  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.chunks.chunk = 32  # type: ignore[misc]
    assert tuple(plan.decisions()) == DECISIONS
    assert all(c.value and c.reason for c in plan.decisions().values())
    assert plan.layout.mode == "layers" and plan.executor.value == "wavefront" and plan.chunks.lanes == 2
    assert plan.chunk == 16 and plan.chunks.max_rows == int(OVERSIZE * 16)  # the wavefront's chunks: up to 1.5·C
    assert methods.host_plan(quantized, "hetero-lanes", chunk=16, threads=2).executor.value == "out-of-order"
    assert methods.host_plan(quantized, "float", chunk=16).layout is None


def test_hetero_info_prints_every_decision_with_its_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    path = write_gguf(make_tiny_model(), tmp_path / "tiny.gguf")
    assert main(["info", "--model", str(path)]) == 0
    text = capsys.readouterr().out
    section = text.split("\nhost plan\n")[1].split("\ncalibration\n")[0].splitlines()
    assert [line.split()[0] for line in section] == list(DECISIONS)
    assert all("; why: " in line and not line.endswith("why: ") for line in section)
    assert main(["info", "--model", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["host_plan"]
    assert list(plan) == list(DECISIONS) and all(d["value"] and d["reason"] for d in plan.values())


def test_the_runtime_runs_what_the_plan_says(quantized):
    """A plan forced to other choices than this host's: the backend, the executor and the decode step follow it."""
    from hetero.decode.step import DecodeStep, step_logits
    from hetero.native.attention import unavailable

    if unavailable(quantized.config) is not None:
        pytest.skip(f"the BF16 attention kernel cannot run here: {unavailable(quantized.config)}")
    plan = methods.host_plan(quantized, "hetero", chunk=16, threads=2)
    assert plan.attention.value == "bf16"
    ids = np.random.default_rng(0).integers(0, 256, 40)
    rt = methods.runtime_of(quantized, plan)
    assert rt.host_plan is plan and rt.chunk == 16 and rt.backend.attention is not None and rt.placement == HALF_PLACEMENT
    assert rt.backend.native_ops == (plan.glue.value == "native")
    assert isinstance(rt.executor, WavefrontExecutor) and rt.head is step_logits  # (made before the runtime: no closure)
    want = rt.prefill(ids)
    assert [c.n_valid for c in rt.plan(ids).chunks] == [c.n_valid for c in plan.chunks.cut(40, 0, True)]
    gqa = dataclasses.replace(plan, attention=Choice("gqa", "forced"), glue=Choice("onnx", "forced"),
                              executor=Choice("in-order", "forced"), chunks=ChunkRule(16),
                              decode=dataclasses.replace(plan.decode, small_kernel="nbits"))
    other = methods.runtime_of(quantized, gqa)
    assert other.backend.attention is None and not other.backend.native_ops
    assert isinstance(other.executor, SerialExecutor) and other.placement == LAYER_PLACEMENT
    assert DecodeStep.of(other).kernel == "nbits"  # the plan's decode kernel, not this host's choice
    np.testing.assert_allclose(other.prefill(ids).logits, want.logits, rtol=0, atol=0.05 * np.abs(want.logits).max())
    for r in (rt, other):
        r.close()


def test_the_chunk_length_cannot_disagree(quantized):
    plan = methods.host_plan(quantized, "hetero-lanes", chunk=16, threads=2)
    backend = NpuBackend(quantized, tiny_plan(quantized), 16)
    with pytest.raises(ConfigError, match="disagrees with the host plan's C=16"):
        Runtime(quantized, chunk=32, backend=backend, host_plan=plan)
    with pytest.raises(ConfigError, match="the host plan holds decode, execution"):
        Runtime(quantized, backend=backend, host_plan=plan, decode=plan.decode, execution=plan.execution)
    fixed = NpuBackend(quantized, tiny_plan(quantized), 32, options=GraphOptions(dynamic_rows=False))  # [32, ·] graphs
    with pytest.raises(ConfigError, match="differs from the 32 rows its backend's graphs take"):
        Runtime(quantized, backend=fixed, host_plan=plan)
    with pytest.raises(ConfigError, match="differs from the 16 its executor's costs were made for"):
        Runtime(quantized, chunk=32, backend=backend, executor=OutOfOrderExecutor(2, 16, "rank"))
    rt = Runtime(quantized, backend=backend, host_plan=plan)
    assert rt.chunk == plan.chunk == 16 and rt.buffers.rule is plan.chunks  # C lives in the plan; the buffers read it
    given = Runtime(quantized, chunk=ChunkRule(16, lanes=2), backend=backend)
    assert isinstance(given.host_plan, HostPlan) and given.host_plan.chunks.max_rows == 24
    rt.close()
    given.close()
