"""`bench.prefill_parts` splits real prefills by subgraph kind and lane and renders its table; no timing
thresholds here (bench/)."""

from __future__ import annotations

import numpy as np

from bench.prefill_parts import markdown, parts
from hetero.runtime import Runtime
from hetero.sched.executor import OutOfOrderExecutor
from tests.conftest import make_tiny_model


def test_parts_cover_every_kind_and_lane() -> None:
    m = make_tiny_model()
    serial = Runtime(m, chunk=16)
    ooo = Runtime(m, chunk=16, executor=OutOfOrderExecutor(m.config.n_layers, 16, "rank"))
    try:
        row = parts(ooo, serial, np.arange(40) % 256, repeats=1, threads=2)
    finally:
        ooo.close()
    assert row["prompt_len"] == 40 and set(row["kinds_ms"]) == {"qkv", "attn", "o_ffn"}
    assert set(row["lanes_busy_ms"]) == {"npu", "cpu"} and row["critical_lane"] in ("npu", "cpu")
    assert all(isinstance(row[k], float) for k in ("in_order_ms", "out_of_order_ms"))  # sizes: bench/, not tests
    table = markdown({"model": "tiny", "method": "float-ooo", "threads": 2, "repeats": 1, "machine": "x",
                      "command": "c", "rows": [row]})
    assert "| 40 |" in table and "npu busy" in table


def test_ops_table_names_lanes_inside_and_outside_ort() -> None:
    from bench.prefill_parts import ops_markdown

    row = {"prompt_len": 64, "wall_ms": 180.3, "dispatch_ms": 0.4, "lanes_busy_ms": {"npu": 100.8, "cpu": 23.6},
           "npu": {"busy_ms": 100.8, "ort_run_ms": 65.6, "kernels_ms": 62.2, "runs": 78, "outside_ort_ms": 35.2},
           "cpu": {"busy_ms": 23.6, "ort_run_ms": 19.6, "kernels_ms": 19.0, "runs": 30, "outside_ort_ms": 4.0},
           "ops_ms": {"MatMulIntegerToFloat": 49.1, "GroupQueryAttention": 19.0},
           "parts_ms": {"int8 linears": 49.1, "attention": 19.0}}
    text = "\n".join(ops_markdown([row]))
    assert "| 64 | 180.3 | npu | 100.8 | 65.6 (78) | 62.2 | 35.2 | 0.4 |" in text
    assert "MatMulIntegerToFloat 49.1 (72%)" in text and "int8 linears 49.1 (72%), attention 19.0 (28%)" in text


def test_profile_splits_a_whole_layer_graph_into_its_parts(tmp_path, monkeypatch) -> None:
    """Every kernel of a profiled whole-layer prefill lands in a named part of the layer (the node names of
    `npu.export`, kept through ONNX Runtime's fusions), and the parts add up to the op types' sum."""
    import time

    from bench.ort_profile import collect
    from hetero.npu.nodes import LAYER_PLACEMENT
    from hetero.npu.graph_backend import GraphOptions, NpuBackend
    from hetero.runtime import SerialExecutor
    from hetero.threads import ORT_PROFILE
    from tests.npu.conftest import SHADOWS, tiny_plan

    monkeypatch.setenv(ORT_PROFILE, str(tmp_path))
    m = make_tiny_model()
    plan = tiny_plan(m, SHADOWS, scale=0.03)
    be = NpuBackend(m, plan, 32, options=GraphOptions(fused=True, use_cache=False))
    rt = Runtime(m, chunk=32, backend=be, executor=SerialExecutor(m.config.n_layers, LAYER_PLACEMENT))
    ids = np.random.default_rng(0).integers(0, 256, 40)
    t0 = time.time_ns()
    rt.prefill(ids)
    (prof,) = collect([(t0, time.time_ns())])
    parts = {k: v for k, v in prof.part_us.items() if v > 0}
    assert {"attention", "int8 linears", "shadow (Eq. 1)", "RMSNorm", "activation", "quantize"} <= set(parts)
    assert not [k for k in parts if k.startswith("other")], parts
    assert abs(sum(prof.part_us.values()) - sum(prof.op_us.values())) < 1e-6


def test_ops_table_sums_lanes_that_share_whole_layer_graphs() -> None:
    """Whole-layer graphs on both lanes (`sched.wavefront`): one session serves both, so one row sums them."""
    from bench.prefill_parts import ops_markdown

    row = {"prompt_len": 64, "wall_ms": 48.0, "dispatch_ms": 0.0, "lanes_busy_ms": {"npu": 42.8, "cpu": 40.9},
           "all lanes": {"busy_ms": 83.7, "ort_run_ms": 77.9, "kernels_ms": 72.0, "runs": 61, "outside_ort_ms": 5.8},
           "ops_ms": {"MatMulIntegerToFloat": 54.0}, "parts_ms": {"int8 linears": 54.0}}
    text = "\n".join(ops_markdown([row]))
    assert "| 64 | 48.0 | all lanes | 83.7 | 77.9 (61) | 72.0 | 5.8 | 0.0 |" in text and "| npu |" not in text
