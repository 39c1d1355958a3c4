"""`bench.decode_step` attributes a profiled INT8 step to its parts (the functions it names exist and
run) and renders its table; no timing thresholds here (bench/)."""

from __future__ import annotations

import pytest

from bench.decode_step import chunk_costs, markdown, step_parts
from hetero.npu.graph_backend import NpuBackend
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model
from tests.npu.conftest import SHADOWS, tiny_plan


@pytest.fixture(autouse=True)
def graph_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))


def test_step_parts_names_every_part_of_an_int8_step():
    m = make_tiny_model()
    rt = Runtime(m, chunk=16, backend=NpuBackend(m, tiny_plan(m, SHADOWS), 16, provider="cpu"))
    row = step_parts(rt, list(range(3, 30)), steps=3, threads=1)
    assert row["context"] == 27 and isinstance(row["step_ms"], float)  # a measured value; its size is bench/'s
    parts = row["parts_ms"]
    assert set(parts) == {"graphs", "attention", "head", "shadow", "rest"}
    # every part's functions were found in the profile (their times can round to 0.00 ms on a tiny model)
    assert row["profiled"] == ["attention", "graphs", "head", "shadow"]
    assert all(v >= 0 for v in parts.values())
    table = markdown({"model": "tiny", "method": "hetero", "threads": 1, "isa": {}, "command": "c", "rows": [row]})
    assert "| 27 |" in table and "graphs" in table


def test_chunk_costs_time_every_static_chunk_size_and_render():
    from hetero.decode.step import TREE_SIZES

    m = make_tiny_model()
    rt = Runtime(m, chunk=16, backend=NpuBackend(m, tiny_plan(m, SHADOWS), 16, provider="cpu"))
    row = chunk_costs(rt, list(range(3, 30)), steps=2, threads=1)
    assert list(row["ms"]) == [str(c) for c in TREE_SIZES] and row["ratio"]["1"] == 1.0
    assert all(isinstance(v, float) for v in row["ms"].values())
    table = markdown({"model": "tiny", "method": "hetero", "threads": 1, "isa": {}, "command": "c", "rows": [],
                      "chunks": [row]})
    assert "| 27 |" in table and "C = 8" in table


def test_attention_threads_compares_one_and_two_threads_and_renders():
    from bench.decode_step import attention_threads

    m = make_tiny_model()
    rt = Runtime(m, chunk=16, backend=NpuBackend(m, tiny_plan(m, SHADOWS), 16, provider="cpu"))
    row = attention_threads(rt, list(range(3, 30)), steps=2, threads=1)
    assert row["same_logits"] is True  # the shared kernel is bit for bit the one-thread kernel
    assert isinstance(row["one_ms"], float) and isinstance(row["two_ms"], float)
    table = markdown({"model": "tiny", "method": "hetero", "threads": 1, "isa": {}, "command": "c", "rows": [],
                      "attention_threads": [row]})
    assert "| 27 |" in table and "heads the helper took" in table


def test_step_kernels_time_each_kernel_that_runs_here_and_render():
    from bench.decode_step import step_kernels
    from hetero.native import gemv
    from hetero.npu.placement import decode_placement

    m = make_tiny_model()
    if gemv.unavailable(m.config) is not None:
        pytest.skip(f"hetero's int8 GEMVs cannot run here: {gemv.unavailable(m.config)}")
    be = NpuBackend(m, tiny_plan(m, SHADOWS), 16, provider="cpu")
    row = step_kernels(Runtime(m, chunk=16, backend=be, decode=decode_placement(be)), list(range(3, 30)), steps=2,
                       threads=1)
    assert set(row["ms"]) == {"nbits", "gemv"}  # a float model has no GGUF blocks
    assert row["speedup_over_nbits"]["nbits"] == 1.0 and row["logits_rel_diff_vs_nbits"]["nbits"] == 0.0
    assert isinstance(row["logits_rel_diff_vs_nbits"]["gemv"], float)
    table = markdown({"model": "tiny", "method": "hetero", "threads": 1, "isa": {}, "command": "c", "rows": [],
                      "kernels": [row]})
    assert "| 27 |" in table and "logits vs nbits" in table and "gemv" in table
