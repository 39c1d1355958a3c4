"""One-row decode graphs split at their INT8 matmuls into column halves (hetero/decode/halves.py), run through
ONNX Runtime's C API (ortc) on one thread or shared with the helper thread (attnpool.run_stages)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from hetero.decode.twocore import ortc
from hetero.decode.twocore.attnpool import AttentionPool
from hetero.decode.twocore.stages import Stages
from hetero.decode.twocore.halves import split_graph
from hetero.decode.step import DECODE_THREADS
from hetero.npu.graph_backend import NpuBackend
from tests.conftest import make_tiny_model
from tests.npu.conftest import SHADOWS, tiny_plan
from tests.npu.test_site_ops import FORMS, rotated_a16_plan


def _one_row_graphs(form: str, kind: str):
    m = make_tiny_model()
    plan = tiny_plan(m, SHADOWS) if kind == "w8a8" else rotated_a16_plan(m, form, ("down_in",), SHADOWS)
    be = NpuBackend(m, plan, 16, provider="cpu").at_chunk(1, DECODE_THREADS)
    return [r.graph for layer in be.layers for r in be.program(layer).runs]


def _whole(g, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(zip([o.name for o in g.session.get_outputs()], g.session.run(None, feeds)))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["w8a8", "rot-a16"])
def test_split_graphs_compute_the_whole_graphs_outputs_bit_for_bit(form, kind):
    """Every one-row graph of a tiny model's plan, its stages run through the C API in order (both halves on one
    thread), against the whole graph in onnxruntime's Python API."""
    rng = np.random.default_rng(0)
    split = 0
    for g in _one_row_graphs(form, kind):
        ins = {name: rng.standard_normal((1, w)).astype(np.float32) * 3 for name, w in g.inputs.items()}
        outs = {name: np.full((1, w), np.nan, np.float32) for name, w in g.outputs.items()}
        stages = Stages()
        span = stages.add(onnx.load(str(g.path)), ins, outs)
        if span is None:  # no MatMulIntegerToFloat (a 16-bit site's matmul): the graph stays whole
            assert not any(n.op_type == "MatMulIntegerToFloat" for n in onnx.load(str(g.path)).graph.node)
            continue
        split += 1
        stages.table().run_here(*span)
        want = _whole(g, ins)
        for name, t in outs.items():
            assert np.array_equal(t, want[name]), f"layer {g.spec.layer} {g.spec.kind}: {name}"
    assert split > 0


def test_shared_stages_equal_whatever_thread_runs_a_half():
    """The helper claims a stage's second half or the main thread takes it back; either way the outputs are
    the whole graph's. Without a helper step in progress every half is taken back (deterministic)."""
    g = next(g for g in _one_row_graphs(FORMS[0], "w8a8") if g.spec.kind != "qkv")
    rng = np.random.default_rng(1)
    ins = {name: rng.standard_normal((1, w)).astype(np.float32) for name, w in g.inputs.items()}
    outs = {name: np.zeros((1, w), np.float32) for name, w in g.outputs.items()}
    stages = Stages()
    span = stages.add(onnx.load(str(g.path)), ins, outs)
    table = stages.table()
    want = _whole(g, ins)
    pool = AttentionPool()
    try:
        k = np.zeros((1, 1, 4, 8), np.float32)
        q = np.zeros((1, 1, 1, 8), np.float32)
        none = np.zeros((1, 1), np.int64)
        for rep in range(30):
            for t in outs.values():
                t[...] = 0
            pool._off = 0
            shared = pool.begin(k, k, q, none, np.ones(1, np.int64), 1.0, q.copy())
            pool.run_stages(table, *span)  # both threads, or this one when the helper is still leaving a step
            if shared:
                pool.end()
            for name, t in outs.items():
                assert np.array_equal(t, want[name]), f"run {rep}: {name}"
            while not pool._idle.wait(0.01):
                pass
    finally:
        pool.close()


def test_a_graph_without_an_int8_matmul_is_not_split():
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    assert split_graph(helper.make_model(g)) is None


def test_a_failed_run_raises_onnx_runtimes_message():
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    sess = ortc.OrtC.get().session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.zeros((1, 4), np.float32)
    with pytest.raises(ortc.OrtError, match="nope"):
        sess.bind({"nope": (x.ctypes.data, (1, 4))}, {})
