"""`hetero.Service` from Python (no HTTP): contexts, limits, and float-identical replies under a tiny budget."""

from __future__ import annotations

import pytest

import hetero
from hetero.decode import SamplingParams
from hetero.serve import ContextLimit, StoreConfig, UnknownContext

TURNS = ["Name a colour.", "Why that one?", "Name another."]


def converse(service: hetero.Service, n_contexts: int = 2) -> list[list[str]]:
    """Turns of several contexts interleaved (each turn switches context), greedy, 6 tokens each."""
    params = SamplingParams(max_new_tokens=6)
    cids = [service.create_context(system=f"You are assistant number {i}.") for i in range(n_contexts)]
    replies: list[list[str]] = [[] for _ in cids]
    for question in TURNS:
        for i, cid in enumerate(cids):
            replies[i].append(service.chat([{"role": "user", "content": question}], params, context_id=cid).text)
    for cid in cids:
        service.delete_context(cid)
    return replies


def test_contexts_and_limits(default_model: hetero.Model) -> None:
    with hetero.Service(hetero.Runtime(default_model, chunk=32), StoreConfig(exact=False),
                        max_contexts_per_client=1) as service:
        cid = service.create_context(system="Be brief.")
        with pytest.raises(ContextLimit, match="limit 1"):
            service.create_context()
        assert service.create_context(client="other")  # the limit is per client
        p = SamplingParams(max_new_tokens=4)
        first = service.chat("Hello!", p, context_id=cid)
        second = service.chat("And again?", p, context_id=cid)
        # the second turn re-prefills nothing of the first: its prompt, and the reply's K/V written by decode
        assert second.usage.cached_tokens >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
        assert [m["role"] for m in service.context(cid).messages] == ["system", "user", "assistant", "user", "assistant"]
        service.delete_context(cid)
        with pytest.raises(UnknownContext):
            service.chat("Hi", p, context_id=cid)


@pytest.mark.slow
def test_tight_budget_gives_identical_float_replies(default_model: hetero.Model) -> None:
    """Every context switch restores from disk or recomputes: the float replies equal the unbounded run's."""
    runtime = hetero.Runtime(default_model, chunk=32)
    with hetero.Service(runtime, StoreConfig(budget_bytes=None)) as service:
        free = converse(service)
    tight = StoreConfig(budget_bytes=2 << 20, compress="off")  # ~45 tokens of K/V: less than one context
    with hetero.Service(runtime, tight) as service:
        assert converse(service) == free
        counts = service.stats()["counts"]
    assert counts.get("swap_in_blocks", 0) + counts.get("recomputed_blocks", 0) > 0


def test_a_request_prefills_as_one_plan_on_both_lanes() -> None:
    """A multi-chunk prompt is one out-of-order plan (not one-chunk plans): the last prefill's timeline
    holds every chunk's subgraphs, on both lanes."""
    from hetero.sched.executor import OutOfOrderExecutor
    from tests.conftest import make_tiny_model

    model = make_tiny_model()
    rt = hetero.Runtime(model, chunk=16, executor=OutOfOrderExecutor(model.config.n_layers, 16, "rank"))
    with hetero.Service(rt) as service:
        reply = service.complete(list(range(3, 60)), SamplingParams(max_new_tokens=2))
        t = service.last_prefill
    rt.close()
    assert reply.usage.prompt_tokens == 57 and t["tokens"] == 57 and t["chunks"] == 4
    assert t["policy"] == "rank" and {n[3] for n in t["nodes"]} == {"npu", "cpu"}
    assert len(t["nodes"]) == 4 * model.config.n_layers * 3 and {n[0] for n in t["nodes"]} == {0, 1, 2, 3}


def test_warm_up_leaves_no_trace(default_model: hetero.Model) -> None:
    with hetero.Service(hetero.Runtime(default_model, chunk=32)) as service:
        assert service.warm_up() > 0
        assert service.store.stats()["blocks"] == {} and service.metrics.text().count(b"hetero_requests_total{") == 0
        assert service.complete("The capital of France is", SamplingParams(max_new_tokens=3)).usage.cached_tokens == 0
