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
