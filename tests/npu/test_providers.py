"""Lane selection: QNN requested but absent → one warning, CPU EP; QNN options from the environment."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from hetero.errors import BackendUnavailable, ConfigError
from hetero import paths
from hetero.npu import providers


def test_qnn_absent_falls_back_to_cpu_with_one_warning(monkeypatch, caplog):
    def absent():
        raise BackendUnavailable("QNN EP unavailable: test")

    monkeypatch.setattr(providers, "qnn_devices", absent)
    monkeypatch.setattr(paths, "_WARNED", set())
    with caplog.at_level(logging.WARNING):
        first, second = providers.make_provider("qnn"), providers.make_provider("qnn")
    assert isinstance(first, providers.OrtCpuProvider) and isinstance(second, providers.OrtCpuProvider)
    assert caplog.text.count("falling back to the ONNX Runtime CPU EP") == 1


def test_qnn_options_from_the_environment(monkeypatch):
    env_qnn_options = providers.env_qnn_options
    monkeypatch.setenv("HETERO_QNN_OPTIONS", " soc_model=60, htp_performance_mode=burst ")
    assert env_qnn_options() == {"soc_model": "60", "htp_performance_mode": "burst"}
    monkeypatch.setenv("HETERO_QNN_OPTIONS", "")
    assert env_qnn_options() == {}
    monkeypatch.setenv("HETERO_QNN_OPTIONS", "soc_model")
    with pytest.raises(ConfigError, match="HETERO_QNN_OPTIONS"):
        env_qnn_options()


def _scale_graph() -> providers.Graph:
    """y = 2·x + h over [rows, 4] float32 (rows dynamic), as a Graph."""
    from onnx import TensorProto, helper, numpy_helper

    from hetero.npu.segments import DYNAMIC_ROWS, SegmentSpec
    from hetero.sessions import cpu_session

    v = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["T", 4])  # noqa: E731
    graph = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["x2"]), helper.make_node("Add", ["x2", "h"], ["y"])],
                              "scale", [v("x"), v("h")], [v("y")], [numpy_helper.from_array(np.float32(2.0), "two")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    spec = SegmentSpec(layer=0, kind="qkv", pieces=("qkv",), chunk=DYNAMIC_ROWS, flavor="cpu")
    return providers.Graph(cpu_session(model.SerializeToString(), 1), spec, {"x": 4, "h": 4}, {"y": 4}, "cpu")


def test_graph_runs_reuse_a_binding_only_for_the_same_buffers():
    g, rng = _scale_graph(), np.random.default_rng(0)
    x, h = rng.standard_normal((2, 6, 4), dtype=np.float32), rng.standard_normal((2, 6, 4), dtype=np.float32)
    out = np.zeros((2, 6, 4), np.float32)
    for rows in (6, 3, 6):  # each buffer set and row count, again after another's
        for i in (0, 1, 0):
            out[i] = 0
            g.run({"x": x[i, :rows], "h": h[i, :rows]}, {"y": out[i, :rows]})
            np.testing.assert_array_equal(out[i, :rows], 2 * x[i, :rows] + h[i, :rows])
            assert not out[i, rows:].any()
    x[0] += 1  # the same buffers with new contents: read anew
    g.run({"x": x[0], "h": h[0]}, {"y": out[0]})
    np.testing.assert_array_equal(out[0], 2 * x[0] + h[0])
    with pytest.raises(ConfigError, match=r"takes \[rows, 4\] for x"):
        g.run({"x": x[0][:, :3], "h": h[0]}, {"y": out[0]})
    with pytest.raises(ConfigError, match="must be"):
        g.run({"x": x[0], "h": h[0]}, {"y": out[0][:2]})


def test_sessions_without_an_arena_of_their_own_share_the_process_arena():
    """A session that keeps no arena of its own (the graphs' sessions, `OrtCpuProvider`) allocates from the process's
    one arena (`sessions.shared_arena`, registered once however many sessions are made), with the same results."""
    import onnx
    from onnx import TensorProto, helper

    from hetero.sessions import cpu_session

    w = np.random.default_rng(0).standard_normal((64, 300), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [None, 300])],
        [onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    x = np.random.default_rng(1).standard_normal((256, 64), dtype=np.float32)
    own = cpu_session(model, 1, "session")
    with pytest.raises(RuntimeError, match="use_env_allocators"):
        own.get_session_options().get_session_config_entry("session.use_env_allocators")
    shared = [cpu_session(model, 1, "session", arena=False) for _ in range(2)]
    want = own.run(None, {"x": x})[0]
    for s in shared:
        assert s.get_session_options().get_session_config_entry("session.use_env_allocators") == "1"
        assert np.array_equal(s.run(None, {"x": x})[0], want)
