"""Small real fixtures for the scheduler tests: a Profile and compiled DAGs, data only (no model)."""

from __future__ import annotations

import pytest

from hetero.sched.costs import build_dag, compile_dag
from hetero.sched.profile import CostEntry, Profile

LAYER = (("qkv", "npu"), ("attn", "cpu"), ("o_ffn", "npu"))


def toy_profile(chunk_lens=(2, 4), lanes_attn=("cpu", "gpu")) -> Profile:
    """NPU work ~2x CPU work, attention growing with kv_len, like the paper's setting (§3.4)."""
    costs = []
    for c in chunk_lens:
        costs += [CostEntry("qkv", "npu", c, ((0, 3.0 * c),)), CostEntry("o_ffn", "npu", c, ((0, 9.0 * c),)),
                  CostEntry("shadow", "cpu", c, ((0, 0.5 * c),))]
        for lane in lanes_attn:
            costs.append(CostEntry("attn", lane, c, ((c, 3.0 * c), (8 * c, 10.0 * c))))
    return Profile(name="toy", method="derived", simulated=True, costs=tuple(costs), n_layers=2,
                   metadata={"notes": "test fixture"})


def make_dag(n_chunks: int, n_layers: int = 2, layer=LAYER, chunk_len: int = 2, profile: Profile | None = None):
    return compile_dag(build_dag(n_chunks, layer, n_layers), profile or toy_profile(), chunk_len)


@pytest.fixture
def profile() -> Profile:
    return toy_profile()


@pytest.fixture(name="toy_profile")
def toy_profile_factory():
    return toy_profile


@pytest.fixture(name="make_dag")
def make_dag_factory():
    return make_dag


@pytest.fixture
def layer():
    return LAYER


@pytest.fixture
def dag3():
    return make_dag(3)
