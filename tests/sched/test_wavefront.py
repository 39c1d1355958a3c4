"""`sched.wavefront`: whole-layer graphs of a prefill on two single-threaded lanes, chunk by chunk."""

from __future__ import annotations

import threading

import pytest
import numpy as np
import torch

from hetero.chunking import OVERSIZE, ChunkRule, balanced_chunks, lane_chunk, plan_chunks
from hetero.errors import ConfigError
from hetero.nodes import reads_kv
from hetero.npu.nodes import HALF_PLACEMENT, KINDS, LAYER_PLACEMENT
from hetero.schedule import check_schedule
from hetero.sched.wavefront import WavefrontExecutor

LAYER_READS_KV = reads_kv(LAYER_PLACEMENT, KINDS)  # the whole layer reads the K/V earlier chunks wrote


@pytest.mark.parametrize("n,want", [(1, 8), (40, 20), (64, 32), (256, 128), (300, 150), (600, 150), (1024, 256),
                                    (2048, 256)])
def test_lane_chunk_gives_every_lane_as_many_chunks(n, want) -> None:
    c = lane_chunk(n, 256, 2)
    assert c == want
    chunks = plan_chunks(n, c, 0, any_rows=True)
    assert sum(ch.n_valid for ch in chunks) == n and all(ch.rows <= 256 for ch in chunks)
    if n >= 16:  # both lanes get as many chunks, of equal length but the last
        assert len(chunks) % 2 == 0 and len({ch.n_valid for ch in chunks[:-1]}) <= 1
    assert len(plan_chunks(n, lane_chunk(n, 256, 1), 0, any_rows=True)) == -(-n // 256)  # one lane: the runtime's C


@pytest.mark.parametrize("n,start", [(64, 0), (300, 0), (1024, 0), (2048, 0), (4000, 0), (512, 1500), (37, 900)])
def test_balanced_chunks_give_each_chunk_the_same_work(n, start) -> None:
    per_key = 6.6e-4
    chunks = balanced_chunks(n, 256, 2, start, per_key)
    assert [c.start for c in chunks] == [start + sum(c.n_valid for c in chunks[:i]) for i in range(len(chunks))]
    assert sum(c.n_valid for c in chunks) == n and all(c.rows == c.n_valid for c in chunks)
    assert len(chunks) % 2 == 0 or len(chunks) == 1
    assert max(c.n_valid for c in chunks) <= OVERSIZE * 256
    if len(chunks) > 1:
        align = 8 if n >= 64 * len(chunks) else 1  # boundaries on MIN_CHUNK where chunks are long
        assert all((c.start - start) % align == 0 for c in chunks)
        work = [c.n_valid + per_key * ((c.start + c.n_valid) ** 2 - c.start**2) / 2 for c in chunks]
        assert max(work) / min(work) < 1.0 + 2 * align / min(c.n_valid for c in chunks)  # equal up to the rounding
    assert balanced_chunks(n, 256, 2, start, 0.0) == plan_chunks(n, lane_chunk(n, 256, 2), start, any_rows=True)


def test_lane_chunk_refuses_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        lane_chunk(0, 256, 2)
    with pytest.raises(ConfigError):
        WavefrontExecutor(30, LAYER_PLACEMENT, lanes=3)


def test_chunks_alternate_lanes_and_run_after_their_predecessors() -> None:
    ex = WavefrontExecutor(3, LAYER_PLACEMENT)
    dag = ex.compile(4, LAYER_READS_KV)
    assert dag.lanes == ("npu", "cpu") and [dag.lane_of(v) for v in range(0, 12, 3)] == ["npu", "cpu", "npu", "cpu"]
    seen, threads, lock = [], {}, threading.Lock()

    def run(v: int) -> None:
        with lock:
            seen.append(v)
            threads[v] = threading.current_thread().name

    s = ex.execute(dag, run)
    check_schedule(s)  # every node after its predecessors, one node at a time per lane
    assert sorted(seen) == list(range(dag.n_nodes))
    for v in range(dag.n_nodes):  # chunk i on lane i mod 2: the calling thread, then the helper
        assert (threads[v] == threading.current_thread().name) == (dag.chunk[v] % 2 == 0)


def test_the_two_lanes_run_at_once() -> None:
    """Chunk 0's layer 1 and chunk 1's layer 0 are both ready once chunk 0's layer 0 is done: they meet at a barrier,
    which only two lanes running at the same time can pass."""
    ex = WavefrontExecutor(2, LAYER_PLACEMENT)
    dag = ex.compile(2, LAYER_READS_KV)
    meet = threading.Barrier(2, timeout=30)
    both = {dag.node_id(0, 1), dag.node_id(1, 0)}
    ex.execute(dag, lambda v: meet.wait() if v in both else None)


def test_steps_pause_and_resume() -> None:
    ex = WavefrontExecutor(3, LAYER_PLACEMENT)
    dag = ex.compile(4, LAYER_READS_KV)
    ran: list[int] = []
    r = ex.start(dag, ran.append)
    steps = 0
    while not r.step(0.0, contended=lambda: True):  # a budget of 0: pause after the first node a lane finishes
        steps += 1
        assert 0 < r.n_done < dag.n_nodes
        with pytest.raises(ConfigError):
            r.schedule()
    assert steps > 1 and sorted(ran) == list(range(dag.n_nodes))
    check_schedule(r.schedule())


def test_an_error_in_a_lane_reaches_the_caller() -> None:
    ex = WavefrontExecutor(2, LAYER_PLACEMENT)
    dag = ex.compile(2, LAYER_READS_KV)
    bad = dag.node_id(1, 1)  # on the helper lane

    def run(v: int) -> None:
        if v == bad:
            raise ValueError("node failed")

    with pytest.raises(ValueError, match="node failed"):
        ex.execute(dag, run)


def test_a_fused_prefill_on_two_lanes_equals_the_one_in_program_order() -> None:
    """The same whole-layer graphs and chunks: the lanes change which thread runs a node, not its result."""
    from hetero.npu.graph_backend import GraphOptions, NpuBackend
    from hetero.runtime import Runtime, SerialExecutor
    from tests.conftest import make_tiny_model
    from tests.npu.conftest import SHADOWS, tiny_plan

    tiny = make_tiny_model()
    plan = tiny_plan(tiny, SHADOWS, scale=0.03)
    be = NpuBackend(tiny, plan, 32, options=GraphOptions(fused=True, intra_op_threads=1))
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(0))
    lanes = Runtime(tiny, chunk=ChunkRule(32, lanes=2), backend=be,
                    executor=WavefrontExecutor(tiny.config.n_layers, LAYER_PLACEMENT))
    got = lanes.prefill(ids)
    assert got.schedule.policy == "wavefront" and got.schedule.dag.n_chunks == 4  # 70 tokens at C <= 32: 18 + 18 + 18 + 16
    check_schedule(got.schedule)
    order = Runtime(tiny, chunk=lane_chunk(70, 32, 2), backend=be,
                    executor=SerialExecutor(tiny.config.n_layers, LAYER_PLACEMENT))
    want = order.prefill(ids)
    assert np.array_equal(got.logits, want.logits)
    assert np.array_equal(got.cache.k[:, :, :70], want.cache.k[:, :, :70])
    assert np.array_equal(got.cache.v[:, :, :70], want.cache.v[:, :, :70])
    more = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))  # the next turn, on the cache
    assert np.array_equal(lanes.prefill(more, got.cache).logits, order.prefill(more, want.cache).logits)
    # chunks of equal work, the first longer than C (up to the rule's 1.5·C rows, which its buffers hold): the same
    # answer, other sums
    balanced = Runtime(tiny, chunk=ChunkRule(16, lanes=2, per_key=0.02), backend=be,
                       executor=WavefrontExecutor(tiny.config.n_layers, LAYER_PLACEMENT))
    got = balanced.prefill(ids)
    sizes = [c.n_valid for c in balanced.plan(ids).chunks]
    assert sizes[0] > 16 and sizes == sorted(sizes, reverse=True) and sum(sizes) == 70
    np.testing.assert_allclose(got.logits, want.logits, rtol=0, atol=1e-4)


def test_halves_wait_for_the_earlier_chunks_attention_only() -> None:
    """`npu.nodes.HALF_PLACEMENT`: chunk i's q|k|v + attention of layer l after its own layer l - 1 and chunk i - 1's
    attention of layer l; its o→FFN after its own attention, never after another chunk's FFN."""
    ex = WavefrontExecutor(3, HALF_PLACEMENT)
    dag = ex.compile(2, reads_kv(HALF_PLACEMENT, KINDS))
    assert dag.kinds == ("layer_attn", "layer_ffn") and dag.n_nodes == 12
    preds = lambda v: set(dag.pred_idx[dag.pred_ptr[v]: dag.pred_ptr[v + 1]])  # noqa: E731
    node = lambda i, layer, half: dag.node_id(i, 2 * layer + half)  # noqa: E731
    assert preds(node(1, 1, 0)) == {node(1, 0, 1), node(0, 1, 0)}
    assert preds(node(1, 1, 1)) == {node(1, 1, 0)}
    meet = threading.Barrier(2, timeout=30)  # chunk 1's first attention runs beside chunk 0's first FFN
    both = {node(0, 0, 1), node(1, 0, 0)}
    check_schedule(ex.execute(dag, lambda v: meet.wait() if v in both else None))


def test_a_prefill_in_halves_equals_the_whole_layers() -> None:
    """The BF16 kernel between each layer's two graphs: the halves as nodes of their own change when a node runs,
    not its result (bit for bit against whole layers on one lane, and against them on two lanes)."""
    from hetero.native.attention import unavailable
    from hetero.npu.graph_backend import GraphOptions, NpuBackend
    from hetero.runtime import Runtime, SerialExecutor
    from tests.conftest import make_tiny_model
    from tests.npu.conftest import tiny_plan

    tiny = make_tiny_model(head_dim=32)
    if unavailable(tiny.config) is not None:
        pytest.skip(f"the BF16 attention kernel cannot run here: {unavailable(tiny.config)}")
    be = NpuBackend(tiny, tiny_plan(tiny, None, scale=0.03), 32,
                    options=GraphOptions(fused=True, intra_op_threads=1, attention="bf16"))
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(0))
    rule = ChunkRule(32, lanes=2)  # the wavefront's chunks: every lane has one
    halves = Runtime(tiny, chunk=rule, backend=be, executor=WavefrontExecutor(tiny.config.n_layers, HALF_PLACEMENT))
    whole = Runtime(tiny, chunk=rule, backend=be, executor=WavefrontExecutor(tiny.config.n_layers, LAYER_PLACEMENT)).prefill(ids)
    serial = Runtime(tiny, chunk=lane_chunk(70, 32, 2), backend=be,
                     executor=SerialExecutor(tiny.config.n_layers, LAYER_PLACEMENT)).prefill(ids)
    for _ in range(8):  # two chunks' o→FFN of one layer may run at once, each on its lane's binding (`Graph.binding`)
        got = halves.prefill(ids)
        assert got.schedule.dag.kinds == ("layer_attn", "layer_ffn")
        check_schedule(got.schedule)
        for want in (whole, serial):
            assert np.array_equal(got.logits, want.logits)
            assert np.array_equal(got.cache.k[:, :, :70], want.cache.k[:, :, :70])
    with pytest.raises(ConfigError, match="attention kernel"):
        NpuBackend(tiny, tiny_plan(tiny, None, scale=0.03), 32,
                   options=GraphOptions(fused=True, attention="gqa")).layer_attn(0, *([None] * 7))


def test_two_lanes_share_two_buffer_sets_with_the_results_of_one_per_chunk() -> None:
    """A lane runs its chunks one after another, so chunk i uses chunk i - 2's buffers (`ChunkBuffers.views`): the
    halves on checked addresses (`npu.nodes.HalvesAt`) give the logits and K/V of a set per chunk, bit for bit."""
    from hetero.native.attention import unavailable
    from hetero.npu.graph_backend import GraphOptions, NpuBackend
    from hetero.runtime import Runtime
    from tests.conftest import make_tiny_model
    from tests.npu.conftest import tiny_plan

    tiny = make_tiny_model(head_dim=32)
    if unavailable(tiny.config) is not None:
        pytest.skip(f"the BF16 attention kernel cannot run here: {unavailable(tiny.config)}")
    be = NpuBackend(tiny, tiny_plan(tiny, None, scale=0.03), 32,
                    options=GraphOptions(fused=True, intra_op_threads=1, attention="bf16"))
    rt = Runtime(tiny, chunk=ChunkRule(32, lanes=2), backend=be,
                 executor=WavefrontExecutor(tiny.config.n_layers, HALF_PLACEMENT))
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(4))
    shared = rt.prefill(ids)
    assert len(shared.schedule.dag.chunk) and max(shared.schedule.dag.chunk) >= 4 and len(rt.buffers.h) == 2
    rt.executor.chunks_in_flight = None
    own = rt.prefill(ids)
    assert len(rt.buffers.h) == max(own.schedule.dag.chunk) + 1
    np.testing.assert_array_equal(shared.logits, own.logits)
    np.testing.assert_array_equal(shared.cache.k[:, :, :200], own.cache.k[:, :, :200])
    np.testing.assert_array_equal(shared.cache.v[:, :, :200], own.cache.v[:, :, :200])
    rt.close()
