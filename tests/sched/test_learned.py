"""Costs that follow the host (`sched.learned`): running averages of real durations, persisted per host."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hetero.errors import ConfigError
from hetero.runtime import Runtime
from hetero.schedule import Schedule
from hetero.sched.executor import OutOfOrderExecutor
from hetero.sched.learned import CostLearner, learned_path
from hetero.sched.profile import load_profile


def _run(dag, us_of) -> Schedule:
    """A real-run Schedule of `dag` whose node v lasted us_of(kind, chunk) µs (nodes back to back)."""
    start, end, t = [], [], 0.0
    for v in range(dag.n_nodes):
        d = us_of(dag.kinds[dag.kind[v]], dag.chunk[v])
        start.append(t)
        end.append(t + d)
        t += d
    return Schedule.of_run("rank", dag, start, end, 0.0)


def test_observations_replace_the_prior_then_average(profile, make_dag, tmp_path) -> None:
    dag = make_dag(3, chunk_len=2)
    learner = CostLearner(profile, 2, tmp_path / "l.json", alpha=0.5)
    assert learner.profile().cost_us("o_ffn", "npu", 2) == 18.0  # the prior (9 µs per row at C = 2)
    learner.observe(dag, _run(dag, lambda kind, i: {"qkv": 10.0, "attn": 100.0 * (i + 1), "o_ffn": 40.0}[kind]))
    p = learner.profile()
    assert p.cost_us("qkv", "npu", 2) == 10.0 and p.cost_us("o_ffn", "npu", 2) == 40.0
    # attention per KV length: the keys the DAG costs chunk i at, (i + 1)·C; the prior's points are gone
    assert [p.cost_us("attn", "cpu", 2, kv) for kv in (2, 4, 6)] == [100.0, 200.0, 300.0]
    assert p.cost_us("attn", "cpu", 2, 16) == 800.0  # affine past the last point
    assert p.cost_us("attn", "gpu", 2, 2) == 6.0  # a lane that never ran keeps the prior
    learner.observe(dag, _run(dag, lambda kind, i: {"qkv": 20.0, "attn": 50.0, "o_ffn": 40.0}[kind]))
    p = learner.profile()
    assert p.cost_us("qkv", "npu", 2) == 15.0 and p.cost_us("attn", "cpu", 2, 2) == 75.0
    assert learner.n_observed == 2 and not p.simulated and p.method == "measured"


def test_saved_costs_are_where_the_next_process_starts(profile, make_dag, tmp_path) -> None:
    dag = make_dag(2, chunk_len=2)
    path = tmp_path / "sub" / "l.json"
    learner = CostLearner(profile, 2, path)
    assert learner.save() is None and not path.exists()  # nothing observed: nothing written
    learner.observe(dag, _run(dag, lambda kind, i: 7.0))
    assert learner.save() == path
    assert not [f for f in path.parent.iterdir() if f.name.endswith(".tmp")]
    again = CostLearner(profile, 2, path)
    assert again.n_observed == 1 and again.profile().cost_us("qkv", "npu", 2) == 7.0
    assert load_profile(path).metadata["learned_from"] == "toy"
    path.write_text("{not json")  # a broken file is a cache miss (logged): the prior again, never half-read
    broken = CostLearner(profile, 2, path)
    assert broken.n_observed == 0 and broken.profile().cost_us("qkv", "npu", 2) == 6.0


def test_learned_costs_are_checked_against_their_record(profile, make_dag, tmp_path, caplog) -> None:
    # a learned profile is a cache entry like the others: a flip behind a kept mtime is caught, never used
    import logging
    import os

    dag = make_dag(2, chunk_len=2)
    path = tmp_path / "l.json"
    learner = CostLearner(profile, 2, path)
    learner.observe(dag, _run(dag, lambda kind, i: 7.0))
    learner.save()
    st = path.stat()
    path.write_text(path.read_text().replace('"observed_prefills": 1', '"observed_prefills": 9'))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with caplog.at_level(logging.WARNING):
        again = CostLearner(profile, 2, path)
    assert "ignoring learned costs" in caplog.text and "content hash" in caplog.text
    assert again.n_observed == 0 and again.profile().cost_us("qkv", "npu", 2) == 6.0


def test_bad_arguments(profile, make_dag, tmp_path, monkeypatch) -> None:
    with pytest.raises(ConfigError, match="alpha"):
        CostLearner(profile, 2, alpha=0)
    with pytest.raises(ConfigError, match="empty"):
        learned_path("///"[:0])
    dag = make_dag(2, chunk_len=2)
    sim = Schedule.of_run("rank", dag, [0.0] * dag.n_nodes, [1.0] * dag.n_nodes, 0.0, simulated=True)
    with pytest.raises(ConfigError, match="simulated"):
        CostLearner(profile, 2).observe(dag, sim)
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    assert learned_path("m/1 x").parent == tmp_path / "profiles" / "learned"
    assert "/" not in learned_path("m/1 x").name[:-5].replace("--", "")


def test_executor_learns_from_its_own_prefills(tiny_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    ex = OutOfOrderExecutor(tiny_model.config.n_layers, 16, "rank", learn_key="tiny-test")
    rt = Runtime(tiny_model, chunk=16, executor=ex)
    ids = np.arange(40) % 256  # 3 chunks: overlapped, so learned from
    try:
        before = ex.profile
        for _ in range(OutOfOrderExecutor.RELEARN_EVERY):
            rt.prefill(ids)
        assert ex.learner.n_observed == OutOfOrderExecutor.RELEARN_EVERY
        assert ex.profile is not before and ex.profile.chunk_lens == (16,)
        rt.prefill(ids[:10])  # one chunk runs as a chain: not what the policy orders, not learned
        assert ex.learner.n_observed == OutOfOrderExecutor.RELEARN_EVERY
    finally:
        rt.close()
    saved = json.loads(learned_path("tiny-test").read_text())
    assert saved["observed_prefills"] == OutOfOrderExecutor.RELEARN_EVERY
    assert {c["kind"] for c in saved["costs"]} >= {"qkv", "attn", "o_ffn"}
