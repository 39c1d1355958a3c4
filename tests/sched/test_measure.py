import pytest

from hetero.errors import ConfigError
from hetero.sched.measure import NotMeasured, measure_profile


def test_measure_profile_times_every_supported_pair():
    calls = []

    def run(kind, lane, c, kv):
        if kind == "attn" and lane == "npu":
            raise NotMeasured
        calls.append((kind, lane, c, kv))

    prof = measure_profile(run, ["qkv", "attn"], ["npu", "cpu"], chunk_lens=(32, 64), kv_lens=(64, 128),
                           repeats=3, warmup=1, name="fake", n_layers=2)
    assert prof.method == "measured" and not prof.simulated
    assert {(e.kind, e.lane) for e in prof.costs} == {("qkv", "npu"), ("qkv", "cpu"), ("attn", "cpu")}
    attn32 = next(e for e in prof.costs if e.kind == "attn" and e.chunk_len == 32)
    assert [kv for kv, _ in attn32.points] == [32, 64, 128]  # kv_len >= C, and C itself
    assert calls.count(("qkv", "npu", 32, 0)) == 4  # warm-up + 3 repeats
    assert {"device", "date", "versions"} <= set(prof.metadata)


def test_measure_profile_rejects_bad_repeats():
    with pytest.raises(ConfigError):
        measure_profile(lambda *a: None, ["qkv"], ["npu"], repeats=0, name="x", n_layers=1)


def test_hetero_profile_times_the_runtimes_own_subgraphs():
    """`hetero profile`'s runner: qkv / o_ffn on the backend, attn through the runtime's attention kernel (the
    one a prefill runs), over kv_len keys; kinds on another lane or a C without graphs are not measured."""
    from hetero.cli.profile import subgraph_runner
    from hetero.runtime import Runtime
    from tests.conftest import make_tiny_model

    m = make_tiny_model()
    rt = Runtime(m, chunk=16)
    calls = []
    real = rt.attention
    rt.attention = lambda *a: calls.append(a[3]) or real(*a)  # record `start`
    prof = measure_profile(subgraph_runner({16: rt}), ["qkv", "attn", "o_ffn"], ["npu", "cpu"], chunk_lens=[16, 32],
                           kv_lens=[64], repeats=1, warmup=0, name="t", n_layers=m.config.n_layers)
    assert {(e.kind, e.lane, e.chunk_len) for e in prof.costs} == {("qkv", "npu", 16), ("attn", "cpu", 16),
                                                                   ("o_ffn", "npu", 16)}
    assert [kv for kv, _ in next(e for e in prof.costs if e.kind == "attn").points] == [16, 64]
    assert sorted(set(calls)) == [0, 48]  # kv_len 16 and 64 for a chunk of 16 rows


def test_hetero_profile_times_a_fused_backends_whole_layers(tmp_path, monkeypatch):
    """The default method's subgraphs are whole layers (`layer`, or the halves `layer_attn`, `layer_ffn` around the
    BF16 kernel): `hetero profile` times those, over kv_len keys where they hold the attention (it once timed
    qkv/attn/o_ffn, which the default does not run, and wrote no cost at all)."""
    from hetero.cli.profile import subgraph_runner
    from hetero.native.attention import unavailable
    from hetero.npu.graph_backend import GraphOptions, NpuBackend
    from hetero.runtime import Runtime, SerialExecutor
    from tests.conftest import make_tiny_model
    from tests.npu.conftest import tiny_plan

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    m = make_tiny_model(head_dim=32)
    cases = [("gqa", (("layer", "npu"),))]
    if unavailable(m.config) is None:
        cases.append(("bf16", (("layer_attn", "npu"), ("layer_ffn", "npu"))))
    for attention, placement in cases:
        be = NpuBackend(m, tiny_plan(m), 16, options=GraphOptions(fused=True, attention=attention))
        rt = Runtime(m, chunk=16, backend=be, executor=SerialExecutor(m.config.n_layers, placement))
        kinds = [k for k, _ in placement]
        prof = measure_profile(subgraph_runner({16: rt}), kinds, ["npu"], chunk_lens=[16], kv_lens=[64], repeats=1,
                               warmup=0, name="t", n_layers=m.config.n_layers)
        assert {e.kind: [kv for kv, _ in e.points] for e in prof.costs} == \
            {k: [0] if k == "layer_ffn" else [16, 64] for k in kinds}
        rt.close()
