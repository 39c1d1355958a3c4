"""The executor runs real callables on lane threads; results must not depend on the order (§3.4)."""

import threading
import time

import numpy as np
import pytest

from hetero.errors import ConfigError, ScheduleError
from hetero.sched.executor import LaneWorkers, execute
from hetero.schedule import check_schedule


class ToyPrefill:
    """A deterministic stand-in for the model: hidden state per chunk, a K/V cache per layer.

    attn of chunk i writes its K/V into the cache and reads chunks 0..i: reading a slot that has not
    been written yet (NaN) would poison the result, so any Eq. 2-3 violation changes the output.
    """

    def __init__(self, dag, jitter_s=0.0, seed=0):
        self.dag, self.jitter_s = dag, jitter_s
        self.rng = np.random.default_rng(seed)
        self.h = [np.full(8, float(i + 1)) for i in range(dag.n_chunks)]
        self.q = [None] * dag.n_chunks
        self.kv = np.full((dag.n_layers, dag.n_chunks, 8), np.nan)
        self.jit = self.rng.uniform(0, jitter_s, dag.n_nodes)
        self.lock = threading.Lock()

    def __call__(self, v):
        i, layer, kind = self.dag.node_info(v)
        if self.jitter_s:
            time.sleep(self.jit[v])
        if kind == "qkv":
            self.q[i] = np.tanh(self.h[i] * (layer + 1) * 0.1)
        elif kind == "attn":
            self.kv[layer, i] = np.sin(self.q[i] + layer)
            w = np.arange(1, i + 2, dtype=float)
            self.q[i] = self.q[i] + (w[:, None] * self.kv[layer, : i + 1]).sum(0) / w.sum()
        else:
            self.h[i] = self.h[i] + np.cos(self.q[i])

    def result(self):
        return np.concatenate([np.stack(self.h).ravel(), self.kv.ravel()])


@pytest.mark.parametrize("policy,seed", [("in_order", 0), ("eq6", 0), ("rank", 0), ("chunk_first", 0),
                                          ("random", 1), ("random", 2), ("random", 3)])
def test_results_are_bit_identical_whatever_the_policy(policy, seed, make_dag):
    dag = make_dag(4, n_layers=3)
    ref = ToyPrefill(dag)
    for v in range(dag.n_nodes):  # program order: the sequential reference
        ref(v)
    toy = ToyPrefill(dag, jitter_s=0.002, seed=seed)
    sched = execute(dag, policy, toy, seed=seed)
    check_schedule(sched)
    assert not sched.simulated and sched.policy == policy
    assert not np.isnan(toy.result()).any()
    assert np.array_equal(toy.result(), ref.result())


def test_per_lane_callables_run_on_their_lane(make_dag):
    dag = make_dag(3)
    seen = {"npu": set(), "cpu": set()}
    threads = {"npu": set(), "cpu": set()}

    def on(lane):
        def fn(v):
            seen[lane].add(v)
            threads[lane].add(threading.current_thread().name)
        return fn

    execute(dag, "rank", {"npu": on("npu"), "cpu": on("cpu")})
    for lane in ("npu", "cpu"):
        assert seen[lane] == {v for v in range(dag.n_nodes) if dag.lane_of(v) == lane}
        assert threads[lane] == {f"hetero-lane-{lane}"}


def test_worker_error_stops_cleanly_and_executor_is_reusable(make_dag):
    dag = make_dag(4)
    bad = dag.node_id(2, 1)  # attn of chunk 2, layer 0
    ran = []

    def work(v):
        if v == bad:
            raise RuntimeError("kernel failed")
        time.sleep(0.001)
        ran.append(v)

    with LaneWorkers(dag.lanes) as ex:
        t0 = time.perf_counter()
        with pytest.raises(ScheduleError, match="attn of chunk 2, layer 0") as info:
            ex.run(dag, "eq6", work, timeout_s=10)
        assert time.perf_counter() - t0 < 5  # no hang
        assert isinstance(info.value.__cause__, RuntimeError)
        descendants = {dag.node_id(i, 1) for i in (3,)} | {dag.node_id(2, j) for j in range(2, dag.per_chunk)}
        assert not descendants & set(ran)  # nothing that needs the failed node ran
        # the same workers run the next prefill
        toy_ok = []
        sched = ex.run(dag, "rank", toy_ok.append)
        check_schedule(sched)
        assert sorted(toy_ok) == list(range(dag.n_nodes))
    assert all(not t.is_alive() for t in ex._threads)


def test_bad_lanes_are_config_errors(make_dag):
    dag = make_dag(2)
    with pytest.raises(ConfigError):
        LaneWorkers(("npu", "tpu"))
    with LaneWorkers(("npu",)) as ex, pytest.raises(ConfigError, match="lacks"):
        ex.run(dag, "rank", lambda v: None)
    with LaneWorkers(dag.lanes) as ex, pytest.raises(ConfigError, match="no callable"):
        ex.run(dag, "rank", {"npu": lambda v: None})


def test_gpu_lane_with_torch_cuda_when_present(make_dag):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the GPU lane is optional")
    layer = (("qkv", "npu"), ("attn", "gpu"), ("o_ffn", "npu"))
    dag = make_dag(3, layer=layer)
    x = torch.ones(256, 256, device="cuda")

    def gpu(v):
        x.copy_(torch.tanh(x @ x * 1e-3))

    sched = execute(dag, "rank", {"npu": lambda v: None, "gpu": gpu}, sync={"gpu": torch.cuda.synchronize})
    check_schedule(sched)
    assert sched.busy_us["gpu"] > 0


def test_toy_detects_a_dependency_violation(make_dag):
    """The order-independence test has teeth: attn of chunk 1 before chunk 0's K/V exists poisons it."""
    dag = make_dag(2)
    toy = ToyPrefill(dag)
    for v in [*range(dag.per_chunk, dag.n_nodes), *range(dag.per_chunk)]:  # chunk 1 first: violates Eq. 2
        toy(v)
    assert np.isnan(toy.result()).any()


def test_a_lane_alone_runs_torch_on_its_alone_thread_count(make_dag):
    import torch

    dag = make_dag(1)  # one chunk: a chain, so every node runs while the other lane is idle
    seen = {}

    def work(v):
        seen[v] = torch.get_num_threads()

    with LaneWorkers(dag.lanes, torch_threads={"npu": (1, 1), "cpu": (1, 2)}) as ex:
        ex.run(dag, "rank", work)
    assert {seen[v] for v in range(dag.n_nodes) if dag.lane_of(v) == "cpu"} == {2}
    assert {seen[v] for v in range(dag.n_nodes) if dag.lane_of(v) == "npu"} == {1}


def test_bad_torch_threads_are_config_errors():
    for bad in ({"tpu": (1, 2)}, {"cpu": (2, 1)}, {"cpu": (0, 1)}):
        with pytest.raises(ConfigError, match="torch_threads"):
            LaneWorkers(("npu", "cpu"), torch_threads=bad)
