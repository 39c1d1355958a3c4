"""The peers' plumbing: the host's description, the peers' model cache, the engine tables, the
best-peer ratios and the interleaved harness. The peers themselves are an optional extra (`bench`): the tests
that run one skip, naming it, where it is not installed. No timing thresholds here (bench/)."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import asdict

import numpy as np
import pytest

from bench import peers
from bench.engines import ENGINES, PEERS
from bench.workers import EngineUnavailable
from bench.harness import Row
from bench.host import describe, host, microarchitecture
from bench.peer_engines import LABELS, MODEL_KIND, check_installed
from bench.report import best_peer_fraction, markdown, vs_best_peer


def test_microarchitecture_from_cpuid() -> None:
    assert microarchitecture("AuthenticAMD", 25, 0x11) == "Zen 4"  # EPYC 9004 (Genoa)
    assert microarchitecture("AuthenticAMD", 26, 0x02) == "Zen 5"
    assert microarchitecture("GenuineIntel", 6, 0x8F) == "Sapphire Rapids"
    assert microarchitecture("GenuineIntel", 6, 0x01) == "unknown (GenuineIntel family 6 model 0x1)"


def test_host_names_the_cpu_and_the_flags_that_matter() -> None:
    h = host()
    assert h["cpu"] and h["cpus"] >= 1 and set(h["isa"]) <= {"avx2", "avx512f", "avx_vnni", "avx512_vnni",
                                                            "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}
    line = describe({**h, "isa": ["avx512f", "avx512_vnni", "avx512_bf16"], "microarchitecture": "Zen 4"})
    assert line.startswith(f"{h['cpu']} (Zen 4)") and "avx512_vnni avx512_bf16, no AMX" in line
    assert "no AMX" not in describe({**h, "isa": ["amx_int8"]})


def test_engine_tables_agree() -> None:
    from bench.prefill import REAL_ENGINES

    assert set(PEERS) == set(MODEL_KIND) == set(LABELS) and set(PEERS) <= set(ENGINES)
    assert set(PEERS) <= set(REAL_ENGINES)
    assert {k for k in MODEL_KIND.values() if k} <= set(peers.KINDS)
    assert MODEL_KIND["llama_cpp"] is None  # the GGUF as shipped, beside llama.cpp's fastest formats


def _writer(calls: list[int], fail: bool = False):
    def build(source, out):
        calls.append(1)
        out.mkdir(parents=True)
        (out / "a.bin").write_bytes(b"\x01" * 1000)
        (out / "sub").mkdir()
        (out / "sub" / "b.txt").write_text(source.name)
        if fail:
            raise RuntimeError("tool failed half-way")
        return {"tool": "1.0"}

    return build


def test_peer_model_is_built_once_atomically_and_verified(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(64))
    calls: list[int] = []
    monkeypatch.setitem(peers.KINDS, "probe", ("gguf", _writer(calls)))
    entry = peers.build(gguf, "probe")
    record = json.loads((entry / peers.RECORD).read_text())
    assert set(record["files"]) == {"a.bin", "sub/b.txt"} and record["tools"] == {"tool": "1.0"}
    assert record["files"]["a.bin"]["size"] == 1000 and (entry / "sub" / "b.txt").read_text() == "m.gguf"
    assert peers.build(gguf, "probe") == entry and calls == [1]  # reused, not rebuilt
    with open(entry / "a.bin", "r+b") as f:  # same size, other bytes: only the content hash catches it
        f.write(b"\x02")
    assert "content hash" in peers.verify(entry)
    assert peers.build(gguf, "probe") == entry and calls == [1, 1] and peers.verify(entry) is None
    assert not list(entry.parent.glob(".*.build"))


def test_failed_peer_build_leaves_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(peers.KINDS, "probe", ("gguf", _writer([], fail=True)))
    with pytest.raises(RuntimeError, match="half-way"):
        peers.build(gguf, "probe")
    root = peers.peers_root(gguf)
    assert not (root / "probe").exists() and not list(root.glob(".*.build"))
    with pytest.raises(EngineUnavailable, match="GGUF"):
        peers.build(tmp_path / "model.safetensors", "probe")


def test_a_tool_that_cannot_convert_the_model_makes_the_peer_unavailable() -> None:
    """A converter's failure (optimum-intel refusing Gemma 3) skips that peer with the tool's last line; the bench
    goes on with the others (`harness.run_engines` skips an `EngineUnavailable`)."""
    import sys

    with pytest.raises(EngineUnavailable, match=r"the exporter failed \(exit 3\): cannot export gemma3"):
        peers._run([sys.executable, "-c", "import sys; print('cannot export gemma3', file=sys.stderr); sys.exit(3)"],
                   "the exporter")


def test_missing_exporter_skips_openvino_before_building_anything(tmp_path, monkeypatch) -> None:
    if importlib.util.find_spec("openvino_genai") is None:
        pytest.skip("openvino-genai not installed (the optional extra 'bench')")
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(peers.OPTIMUM_CLI, str(tmp_path / "no-such-optimum-cli"))
    with pytest.raises(EngineUnavailable, match=peers.OPTIMUM_CLI):
        check_installed("openvino_genai")
    assert not (tmp_path / "cache" / "peers").exists()


def test_a_cached_peer_needs_neither_its_converter_nor_its_sources(tmp_path, monkeypatch) -> None:
    """A built, verified OpenVINO peer model runs without optimum-cli (`$HETERO_OPTIMUM_CLI` unset or wrong) and
    without rebuilding the safetensors it was converted from."""
    if importlib.util.find_spec("openvino_genai") is None:
        pytest.skip("openvino-genai not installed (the optional extra 'bench')")
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(peers.OPTIMUM_CLI, str(tmp_path / "no-such-optimum-cli"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(64))
    calls: list[int] = []
    monkeypatch.setitem(peers.KINDS, "openvino-int8", ("hf", _writer(calls)))
    monkeypatch.setitem(peers.KINDS, "hf", ("gguf", _writer(calls)))
    entry = peers.build(gguf, "openvino-int8")
    assert calls == [1, 1] and peers.cached(gguf, "openvino-int8") == entry
    import shutil

    shutil.rmtree(peers.peers_root(gguf) / "hf")  # the source is gone: the converted model still serves
    check_installed("openvino_genai", gguf)
    assert peers.build(gguf, "openvino-int8") == entry and calls == [1, 1]
    with pytest.raises(EngineUnavailable, match=peers.OPTIMUM_CLI):  # no gguf given: it may have to be built
        check_installed("openvino_genai")


def test_ort_genai_builder_python_is_checked_before_building(tmp_path, monkeypatch) -> None:
    """$HETERO_ORT_GENAI_PYTHON (the builder's own venv, transformers 4 for Gemma 3) that is not an executable
    makes the ONNX Runtime GenAI peer unavailable, naming it, with nothing left in the cache."""
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(peers.ORT_GENAI_PYTHON, str(tmp_path / "no-such-python"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(EngineUnavailable, match=peers.ORT_GENAI_PYTHON):
        peers.build(gguf, "ort-genai-int4")
    assert not (peers.peers_root(gguf) / "ort-genai-int4").exists()


def _row(engine: str, n: int, tps: float) -> Row:
    return Row(engine, n, tps, round(n / tps * 1e3, 2), 100.0, False, [round(n / tps * 1e3, 2)] * 2)


def test_best_peer_is_the_fastest_peer_at_each_length() -> None:
    rows = [_row("hetero", 64, 800.0), _row("llama_cpp_q4_0", 64, 900.0), _row("openvino_genai", 64, 1600.0),
            _row("torch_float", 64, 5000.0),  # not a peer: never the best peer
            _row("hetero", 256, 1000.0), _row("llama_cpp_q4_0", 256, 800.0), _row("openvino_genai", 256, 500.0)]
    best = vs_best_peer(rows, PEERS)
    assert [(b["prompt_len"], b["best_peer"], b["hetero_over"]) for b in best] == [
        (64, "openvino_genai", 0.5), (256, "llama_cpp_q4_0", 1.25)]
    bound = {"per_len": [{"prompt_len": 64, "bound_tokens_per_s": 3200.0}, {"prompt_len": 256, "bound_tokens_per_s": 1600.0}]}
    assert [f["fraction"] for f in best_peer_fraction(best, bound)] == [0.5, 0.5]
    result = {"conditions": {"model": "m", "threads": 2, "statistic": "median", "repeats": 2, "chunk": 256,
                             "machine": "AMD EPYC (Zen 4), 2 CPUs", "date": "d"},
              "rows": [asdict(r) for r in rows],
              "ratios": [], "vs_best_peer": best, "peers": {e: LABELS[e] for e in ("openvino_genai", "llama_cpp_q4_0")},
              "ablation": {"real": [], "simulated": []}, "e2e": [], "skipped": {}}
    md = markdown(result)
    assert "AMD EPYC (Zen 4)" in md and "| 64 | openvino_genai | 1600.0 | 800.0 | 0.50 |" in md
    assert "OpenVINO GenAI, INT8 weights" in md


@pytest.mark.slow
def test_llama_cpp_requantized_runs_the_same_ids(default_model, tmp_path, monkeypatch) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python not installed (the optional extra 'bench')")
    from bench.peer_engines import open_session

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    gguf = str(default_model.path)
    session = open_session("llama_cpp_q8_0", gguf, threads=2, max_len=64)
    ids = list(range(100, 132))
    first = session.prefill(ids)
    seconds, tokens = session.decode(ids, 4)
    assert tokens[0] == first and len(tokens) == 4 and isinstance(seconds, float)  # a measured value; its size is bench/'s
    assert 0 <= first < default_model.config.vocab
    entry = peers.peers_root(default_model.path) / "gguf-q8_0"
    assert peers.verify(entry) is None and (entry / "model.gguf").stat().st_size > default_model.path.stat().st_size


@pytest.mark.slow
def test_harness_interleaves_rounds_over_windows(default_model) -> None:
    from bench.harness import run_engines
    from hetero.outliers.corpus import prompt_ids

    a, b = prompt_ids(None, 16, 1), prompt_ids(None, 16, 2)
    assert a.dtype == b.dtype == np.int64 and a.shape == b.shape == (16,) and not (a == b).all()
    rows, skipped = run_engines(["hetero_float"], [16, 32], 2, 1)
    assert not skipped
    assert [(r.engine, r.prompt_len, len(r.runs_ms)) for r in rows] == [("hetero_float", 16, 2), ("hetero_float", 32, 2)]
    assert all(isinstance(r.peak_rss_mb, float) and isinstance(r.tokens_per_s, float) for r in rows)  # measured values


def test_ort_profile_sums_only_the_window(tmp_path, monkeypatch) -> None:
    import time

    import numpy as np
    from onnx import TensorProto, helper

    from bench.ort_profile import collect
    from hetero.sessions import cpu_session
    from hetero.threads import ORT_PROFILE

    monkeypatch.setenv(ORT_PROFILE, str(tmp_path))
    g = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"]), helper.make_node("Relu", ["y"], ["z"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [64, 64])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    sess = cpu_session(m.SerializeToString(), 1)
    x = {"x": np.ones((64, 64), np.float32)}
    sess.run(None, x)  # before the window: not counted
    t0 = time.time_ns()
    for _ in range(3):
        sess.run(None, x)
    t1 = time.time_ns()
    sess.run(None, x)  # after it
    (prof,) = collect([(t0, t1)])
    assert prof.runs["graphs"] == 3 and set(prof.op_us) == {"MatMul", "Relu"}
    assert 0 < prof.kernel_us["graphs"] <= prof.run_us["graphs"]
    assert not list(tmp_path.glob("*.json"))  # the profile files are removed once read


def test_ort_profile_keeps_every_session_made_in_one_second(tmp_path, monkeypatch) -> None:
    """ONNX Runtime names a profile file by its prefix and the second: sessions made together (a runtime's ~30 layer
    graphs) must not share one file, or all but one session's kernels are lost (or the file is garbled)."""
    import time

    import numpy as np
    from onnx import TensorProto, helper

    from bench.ort_profile import collect
    from hetero.sessions import cpu_session
    from hetero.threads import ORT_PROFILE

    monkeypatch.setenv(ORT_PROFILE, str(tmp_path))
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 8])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    sessions = [cpu_session(m, 1) for _ in range(4)]
    x = {"x": np.ones((8, 8), np.float32)}
    t0 = time.time_ns()
    for sess in sessions:
        for _ in range(2):
            sess.run(None, x)
    (prof,) = collect([(t0, time.time_ns())])
    assert prof.runs["graphs"] == 8 and set(prof.op_us) == {"Relu"}


@pytest.mark.slow
def test_peer_process_decodes_as_the_session_in_this_process(default_model, tmp_path, monkeypatch) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python not installed (the optional extra 'bench')")
    from bench.peer_engines import LlamaCppSession, PeerProcess

    ids = list(range(200, 248))
    here = LlamaCppSession(default_model.path, threads=2, max_len=64, flash_attn=False).decode(ids, 5)[1]
    proc = PeerProcess("llama_cpp", threads=2, max_len=64)
    try:
        seconds, tokens = proc.decode(ids, 5)
    finally:
        proc.close()
    assert tokens == here and isinstance(seconds, float)  # a measured value; its size is bench/'s
