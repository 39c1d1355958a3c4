"""The two-thread attention of a decode step (`decode.attnpool`): whichever thread attends a KV head, the
output and the cache rows are bit for bit the one-thread kernel's; the helper's task and its errors reach the
caller; a late or closed helper never makes the step wait."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from hetero.rope import RopeTable
from hetero.decode.twocore.attnpool import AttentionPool, _claim_heads
from hetero.decode.rowattn import decode_rows, entry, rope_rows, tree_layout
from hetero.decode.tree import TokenTree
from tests.conftest import make_tiny_model



def randn(gen: np.random.Generator, *shape: int) -> np.ndarray:
    return gen.standard_normal(shape, np.float32)


def random_cache(cfg, layers: int, capacity: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng(seed)
    shape = (layers, cfg.n_kv_heads, capacity, cfg.head_dim)
    return randn(gen, *shape), randn(gen, *shape)


@pytest.mark.parametrize("slot", [5, 127, 300])
def test_shared_attention_equals_the_one_thread_kernel(slot):
    layers, capacity = 4, 512
    # layers 1 and 3 slide (a window shorter than a tree path, and one of 200 keys): the job carries it
    cfg = dataclasses.replace(make_tiny_model().config, n_layers=layers, windows=(0, 3, 0, 200))
    rope = RopeTable(cfg, 512)
    tree = TokenTree([1, 2, 3, 4, 5], [-1, 0, 1, 0, 3])
    layout = tree_layout(tree.depth, tree.parents, slot, rope)
    n, g = len(tree), cfg.n_heads // cfg.n_kv_heads
    gen = np.random.default_rng(slot)
    qkvs = [randn(gen, n, cfg.q_dim + 2 * cfg.kv_dim) * 3 for _ in range(layers)]
    k1, v1 = random_cache(cfg, layers, capacity, slot)
    k2, v2 = k1.copy(), v1.copy()
    want = [np.zeros((n, cfg.q_dim), np.float32) for _ in range(layers)]
    for layer in range(layers):
        decode_rows(cfg, qkvs[layer], k1[layer], v1[layer], layout, want[layer], layer)
    pool = AttentionPool()
    try:
        q = np.zeros((n, cfg.n_kv_heads, g, cfg.head_dim), np.float32)
        out = np.zeros((n, cfg.q_dim), np.float32)
        for rep in range(20):  # heads go to either thread; every run must give the one-thread result
            pool._off = 0  # no contention guard here: a tiny step may leave the helper few heads
            assert pool.begin(k2, v2, q, layout.extra, layout.n_extra, cfg.head_dim**-0.5, out.reshape(q.shape))
            if rep % 2:
                time.sleep(0.005)  # the helper is spinning before the first job (else it may still be waking)
            for layer in range(layers):
                pool.attend(cfg, layer, qkvs[layer], layout)
                assert np.array_equal(out, want[layer]), f"layer {layer}, run {rep}"
            pool.end()
            deadline = time.time() + 5
            while not pool._idle.is_set() and time.time() < deadline:  # the next begin needs the helper asleep
                time.sleep(0.001)
        assert np.array_equal(k1, k2) and np.array_equal(v1, v2)  # the rows' K/V landed where the kernel puts them
    finally:
        pool.close()
    assert not pool._thread.is_alive()


def test_the_step_right_after_a_step_gets_the_helper_while_the_caller_runs_python(monkeypatch):
    """A caller that runs Python between steps (`generate`: sampling, text) holds the GIL, which the helper needs to
    report the last step done: `begin` waits for it (the GIL released) instead of running the step on one thread
    (a bare check ran every other step of a decode on one thread). The wait is made long here so that only a
    machine that cannot run the helper for seconds fails this."""
    from hetero.decode.twocore import attnpool

    monkeypatch.setattr(attnpool, "IDLE_WAIT_S", 5.0)
    cfg = dataclasses.replace(make_tiny_model().config, n_layers=1, windows=())
    k, v = random_cache(cfg, 1, 64, 2)
    layout = tree_layout([0], [-1], 20, RopeTable(cfg, 64))
    qkv = randn(np.random.default_rng(2), 1, cfg.q_dim + 2 * cfg.kv_dim)
    q = np.zeros((1, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim), np.float32)
    out = np.zeros((1, cfg.q_dim), np.float32)
    pool = AttentionPool()
    try:
        for _ in range(10):
            pool._off = 0  # no contention guard here: a tiny step may leave the helper few heads
            assert pool.begin(k, v, q, layout.extra, layout.n_extra, cfg.head_dim**-0.5, out.reshape(q.shape))
            pool.attend(cfg, 0, qkv, layout)
            pool.end()
            t = time.perf_counter()
            while time.perf_counter() - t < 0.002:  # Python between steps, the GIL held (its switch interval: 5 ms)
                pass
    finally:
        pool.close()


def test_a_failed_graph_half_raises_onnx_runtimes_message_whoever_ran_it():
    """A stage job (`run_stages`) whose second half cannot run (an input never bound): the main thread raises the
    C API's message whether the helper ran that half or the main thread took it back, in a step or outside one."""
    from onnx import TensorProto, helper

    from hetero.decode.twocore import ortc
    from hetero.decode.twocore.attnpool import StageTable

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    api = ortc.OrtC.get()
    sess = api.session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    x, y = np.ones((1, 4), np.float32), np.zeros((1, 4), np.float32)
    good = sess.bind({"x": (x.ctypes.data, (1, 4))}, {"y": (y.ctypes.data, (1, 4))})
    bad = sess.bind({}, {"y": (y.ctypes.data, (1, 4))})
    table = StageTable(api.run_fn, *(np.array([p], np.int64) for p in (sess.ptr, good.ptr, sess.ptr, bad.ptr)),
                       api.check)
    pool = AttentionPool()
    cfg = make_tiny_model().config
    k, v = random_cache(cfg, 1, 8, 0)
    q = np.zeros((1, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim), np.float32)
    layout = tree_layout([0], [-1], 3, RopeTable(cfg, 16))
    args = (k, v, q, layout.extra, layout.n_extra, 0.125, np.zeros_like(q))
    try:
        with pytest.raises(ortc.OrtError, match="x"):
            pool.run_stages(table, 0, 1)  # no step in progress: both halves here
        for rep in range(3):
            pool._off = 0
            assert pool.begin(*args)
            if rep:
                time.sleep(0.005)  # the helper spinning: it claims the half
            with pytest.raises(ortc.OrtError, match="x"):
                pool.run_stages(table, 0, 1)
            pool.end()
            pool._idle.wait(5)
        assert np.array_equal(y, x)  # the good half ran
    finally:
        pool.close()
    assert not pool.begin(*args)  # closed: steps run on one thread


def test_a_helper_that_cannot_run_is_turned_off_with_a_growing_backoff():
    """The contention guard: a step in which the helper attended under a fifth of the heads (here it never runs,
    as when other processes hold the cores) turns it off for 1, then 2, 4, ... steps; those steps run on one
    thread with the same results."""

    class Asleep:  # a helper thread the OS never schedules
        def is_alive(self) -> bool:
            return True

    layers = 3
    cfg = dataclasses.replace(make_tiny_model().config, n_layers=layers, windows=())
    k, v = random_cache(cfg, layers, 64, 1)
    layout = tree_layout([0], [-1], 20, RopeTable(cfg, 64))
    qkv = randn(np.random.default_rng(1), 1, cfg.q_dim + 2 * cfg.kv_dim)
    q = np.zeros((1, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim), np.float32)
    want_last = np.zeros((1, cfg.q_dim), np.float32)
    decode_rows(cfg, qkv, k[layers - 1].copy(), v[layers - 1].copy(), layout, want_last)
    pool = AttentionPool()
    pool._thread = Asleep()
    began = []
    for _ in range(8):
        out = np.zeros((1, cfg.q_dim), np.float32)
        ok = pool.begin(k, v, q, layout.extra, layout.n_extra, cfg.head_dim**-0.5, out.reshape(q.shape))
        began.append(ok)
        if ok:
            pool._idle.set()  # what the helper would do when it left the step
            for layer in range(layers):
                pool.attend(cfg, layer, qkv, layout)
            assert np.array_equal(out, want_last)  # the main thread attended every head
        pool.end()
    assert began == [True, False, True, False, False, True, False, False]
    assert pool.skipped == 5 and pool.helped == 0


def test_the_helpers_claims_compute_the_one_thread_kernels_heads():
    """The helper's side (`_claim_heads` as the helper calls it), run here so that it claims every head of a job
    whatever the OS schedules: each head equals the one-thread kernel's, and the helper's count covers them."""
    cfg = make_tiny_model().config
    slot = 40
    tree = TokenTree([1, 2, 3], [-1, 0, 0])
    layout = tree_layout(tree.depth, tree.parents, slot, RopeTable(cfg, 128))
    n, g = len(tree), cfg.n_heads // cfg.n_kv_heads
    qkv = randn(np.random.default_rng(3), n, cfg.q_dim + 2 * cfg.kv_dim) * 3
    k, v = random_cache(cfg, 1, 128, 3)
    want = np.zeros((n, cfg.q_dim), np.float32)
    decode_rows(cfg, qkv, k[0].copy(), v[0].copy(), layout, want)
    pool = AttentionPool()
    q = np.zeros((n, cfg.n_kv_heads, g, cfg.head_dim), np.float32)
    rope_rows(cfg, qkv, k[0], v[0], layout, q)
    out = np.zeros((n, cfg.q_dim), np.float32)
    _claim_heads(pool.ctrl, cfg.n_kv_heads, q, k[0], v[0], slot, layout.extra, layout.n_extra,
                 cfg.head_dim**-0.5, out.reshape(q.shape), True, 0, 0, entry())
    assert np.array_equal(out, want) and pool.helped == cfg.n_kv_heads
