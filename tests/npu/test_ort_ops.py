"""hetero's own ONNX Runtime op (`native.ort_ops`): down_in's input in one op, against the nodes it replaces and the
torch reference; the fused backend's o → FFN graphs with it, against the same graphs with the nodes."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from hetero.errors import ConfigError
from hetero.native import ort_ops
from hetero.npu.graph_backend import GraphOptions, NpuBackend
from hetero.outliers.plan import quantize_weights
from hetero.outliers.rotate import block_hadamard
from hetero.outliers.rowscale import ROW_QMAX, ROW_TINY, row_quantize
from hetero.runtime import Runtime, SerialExecutor
from hetero.sessions import cpu_session
from tests.conftest import make_tiny_model
from tests.npu.conftest import tiny_plan

pytestmark = pytest.mark.skipif(ort_ops.unavailable() is not None,
                                reason=f"hetero's ONNX Runtime ops cannot run here: {ort_ops.unavailable()}")


def _op_session(scale: float):
    node = helper.make_node(ort_ops.SILU_HADAMARD_QUANT, ["gate", "up"], ["xq", "row_s"], domain=ort_ops.DOMAIN,
                            block=ort_ops.BLOCK, scale=scale, qmax=float(ROW_QMAX), tiny=float(ROW_TINY))
    f = TensorProto.FLOAT
    g = helper.make_graph([node], "glue", [helper.make_tensor_value_info(n, f, ["T", 256]) for n in ("gate", "up")],
                          [helper.make_tensor_value_info("xq", TensorProto.UINT8, ["T", 256]),
                           helper.make_tensor_value_info("row_s", f, ["T", 1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(ort_ops.DOMAIN, 1)])
    m.ir_version = 10
    return cpu_session(m.SerializeToString(), 1, "session", custom_ops=ort_ops.library_path())


def _inputs() -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    rng = np.random.default_rng(0)
    gate = (rng.standard_normal((9, 256)) * 2).astype(np.float32)
    up = rng.standard_normal((9, 256)).astype(np.float32)
    gate[3, 17], up[3, 17] = 40.0, 30.0  # an outlier row
    gate[5] = 0.0  # SiLU(0) = 0: a row of zeros
    g = torch.from_numpy(gate)
    y = block_hadamard(g * torch.sigmoid(g) * torch.from_numpy(up), ort_ops.BLOCK)  # the nodes' math, in torch
    return gate, up, y


def _agree(got: np.ndarray, want: np.ndarray) -> None:
    """u8 codes equal except, rarely, one step where a value sits on a rounding boundary (float32 sums in another
    order)."""
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())


def test_per_row_op_equals_the_reference():
    gate, up, y = _inputs()
    xq, row_s = _op_session(0.0).run(None, {"gate": gate, "up": up})
    q, m = row_quantize(y)  # `outliers.rowscale`: int8 values and each row's absmax
    _agree(xq, (q.numpy() + 128).astype(np.uint8))
    np.testing.assert_allclose(row_s, (m * torch.tensor(1 / ROW_QMAX)).numpy(), rtol=1e-6)
    assert xq[5].tolist() == [128] * 256 and row_s[5, 0] == np.float32(ROW_TINY) / ROW_QMAX
    assert xq[3].min() == 1 or xq[3].max() == 255  # the outlier row's absmax lands on ±127


def test_row_op_without_silu_equals_the_reference():
    """HadamardRowQuant: a rotated site's input alone (no SiLU·up) at each row's own scale."""
    gate, _, _ = _inputs()
    node = helper.make_node(ort_ops.HADAMARD_ROW_QUANT, ["x"], ["xq", "row_s"], domain=ort_ops.DOMAIN,
                            block=ort_ops.BLOCK, scale=0.0, qmax=float(ROW_QMAX), tiny=float(ROW_TINY))
    f = TensorProto.FLOAT
    g = helper.make_graph([node], "rows", [helper.make_tensor_value_info("x", f, ["T", 256])],
                          [helper.make_tensor_value_info("xq", TensorProto.UINT8, ["T", 256]),
                           helper.make_tensor_value_info("row_s", f, ["T", 1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(ort_ops.DOMAIN, 1)])
    m.ir_version = 10
    sess = cpu_session(m.SerializeToString(), 1, "session", custom_ops=ort_ops.library_path())
    xq, row_s = sess.run(None, {"x": gate})
    q, mx = row_quantize(block_hadamard(torch.from_numpy(gate), ort_ops.BLOCK))
    _agree(xq, (q.numpy() + 128).astype(np.uint8))
    np.testing.assert_allclose(row_s, (mx * torch.tensor(1 / ROW_QMAX)).numpy(), rtol=1e-6)
    assert xq[5].tolist() == [128] * 256  # a row of zeros
    assert xq[3].min() == 1 or xq[3].max() == 255  # the outlier row's absmax lands on ±127


def test_static_op_equals_quantize_linear():
    gate, up, y = _inputs()
    s = np.float32(0.05)
    xq, row_s = _op_session(float(s)).run(None, {"gate": gate, "up": up})
    want = np.clip(np.rint(y.numpy() / s), -128, 127) + 128
    _agree(xq, want.astype(np.uint8))
    assert (xq == 255).any() and (row_s == 1).all()  # the outlier clips


def _rotated(m):
    plan = tiny_plan(m, scale=0.03)
    online = {"down_in": ort_ops.BLOCK}
    plan = dataclasses.replace(plan, online=online, weights=quantize_weights(m, "channel", plan.weight_qmax, online))
    return dataclasses.replace(plan, sites={k: dataclasses.replace(sq, per_row=True) if k[1] == "down_in" else sq
                                            for k, sq in plan.sites.items()})


def _runtime(model, plan, native_ops: bool) -> Runtime:
    from hetero.npu.nodes import LAYER_PLACEMENT

    be = NpuBackend(model, plan, 32, options=GraphOptions(fused=True, attention="bf16", native_ops=native_ops))
    return Runtime(model, chunk=32, backend=be, executor=SerialExecutor(model.config.n_layers, LAYER_PLACEMENT))


def test_o_ffn_graphs_with_the_op_equal_the_nodes():
    from hetero.native.attention import unavailable

    m = make_tiny_model(head_dim=32)  # (ffn 256: four Hadamard blocks)
    if unavailable(m.config) is not None:
        pytest.skip(f"the BF16 attention kernel cannot run here: {unavailable(m.config)}")
    plan = _rotated(m)
    got, want = _runtime(m, plan, True), _runtime(m, plan, False)
    assert got.backend.native_ops and "SiluHadamardQuant" in got.backend.native_ops_why
    qkv, o_ffn = ([n.op_type for n in onnx.load(run.graph.path, load_external_data=False).graph.node]
                  for run in got.backend.program(1).runs)
    assert {ort_ops.SILU_HADAMARD_QUANT, ort_ops.ADD_RMS_NORM_QUANT, ort_ops.SCALE_ADD} <= set(o_ffn), o_ffn
    assert qkv == [ort_ops.RMS_NORM_QUANT, "MatMulIntegerToFloat"], qkv
    assert all(run.graph.spec.native_ops for layer in range(2) for run in got.backend.program(layer).runs)
    assert not want.backend.native_ops and "as asked" in want.backend.native_ops_why
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(7))
    a, b = got.prefill(ids), want.prefill(ids)
    err = np.abs(a.logits - b.logits).max() / np.abs(b.logits).max()
    assert err < 1e-2, err  # rounding of the Hadamard's sums and SiLU; a wrong block or scale moves logits by O(1)
    np.testing.assert_allclose(a.cache.k[0, :, :70], b.cache.k[0, :, :70], rtol=0, atol=1e-6)  # layer 0's K: before


def test_the_op_is_refused_where_the_plan_has_no_down_in_hadamard():
    from hetero.native.attention import unavailable

    m = make_tiny_model(head_dim=32)
    if unavailable(m.config) is not None:
        pytest.skip(f"the BF16 attention kernel cannot run here: {unavailable(m.config)}")
    plan = tiny_plan(m, scale=0.03)
    with pytest.raises(ConfigError, match="64-block online Hadamard at down_in"):
        NpuBackend(m, plan, 32, options=GraphOptions(fused=True, attention="bf16", native_ops=True))
    auto = NpuBackend(m, plan, 32, options=GraphOptions(fused=True, attention="bf16"))
    assert not auto.native_ops and "online Hadamard" in auto.native_ops_why


def test_a_host_where_the_ops_cannot_run_keeps_the_nodes(monkeypatch):
    """What a host without AVX-512 DQ or a compiler does: the nodes, saying why; asked for the ops, one clear error."""
    from hetero.native.attention import unavailable

    m = make_tiny_model(head_dim=32)
    if unavailable(m.config) is not None:
        pytest.skip(f"the BF16 attention kernel cannot run here: {unavailable(m.config)}")
    monkeypatch.setattr(ort_ops, "unavailable", lambda: "this CPU lacks avx512dq")
    plan = _rotated(m)
    be = NpuBackend(m, plan, 32, options=GraphOptions(fused=True, attention="bf16"))
    assert not be.native_ops and "this CPU lacks avx512dq" in be.native_ops_why
    assert not any(run.graph.spec.native_ops for layer in range(2) for run in be.program(layer).runs)
    with pytest.raises(ConfigError, match="cannot run here: this CPU lacks avx512dq"):
        ort_ops.library_path()
    with pytest.raises(ConfigError, match="this CPU lacks avx512dq"):
        NpuBackend(m, plan, 32, options=GraphOptions(fused=True, attention="bf16", native_ops=True))
