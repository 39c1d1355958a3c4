import pytest

from hetero.errors import ConfigError, ScheduleError
from hetero.sched.policy import POLICIES, InOrder
from hetero.schedule import check_schedule
from hetero.sched.simulate import simulate

LAYER3 = (("qkv", "npu"), ("shadow", "cpu"), ("attn", "gpu"), ("o_ffn", "npu"))


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("n_chunks", [1, 2, 5])
def test_every_schedule_is_valid(policy, n_chunks, make_dag):
    d = make_dag(n_chunks)
    s = simulate(d, policy, seed=n_chunks)
    check_schedule(s)  # Eq. 2-3 respected, one subgraph per lane at a time, every node ran once
    assert s.makespan_us >= s.lower_bound_us - 1e-9
    assert sum(s.busy_us.values()) == pytest.approx(sum(d.cost_us))  # nothing leaked, nothing twice
    assert 0.0 <= s.bubble_rate < 1.0 and s.decision_us >= 0.0 and s.simulated


def test_three_lanes(make_dag):
    d = make_dag(4, layer=LAYER3)
    assert d.lanes == ("npu", "cpu", "gpu")
    for policy in POLICIES:
        s = simulate(d, policy)
        check_schedule(s)
        assert set(s.busy_us) == {"npu", "cpu", "gpu"}


def test_in_order_is_program_order_per_lane(make_dag):
    d = make_dag(4)
    s = simulate(d, "in_order")
    for lane in d.lanes:
        order = s.lane_order(lane)
        assert order == sorted(order)


def test_out_of_order_beats_in_order(make_dag):
    d = make_dag(6)
    ms = {p: simulate(d, p).makespan_us for p in POLICIES}
    assert ms["eq6"] < ms["in_order"] and ms["rank"] < ms["in_order"]


def test_deadlocking_policy_raises(make_dag):
    class Stuck(InOrder):
        name = "stuck"

        def pop(self, lane):
            return -1

    with pytest.raises(ScheduleError, match="deadlocked"):
        simulate(make_dag(2), Stuck)


def test_unknown_policy_is_a_config_error(make_dag):
    with pytest.raises(ConfigError, match="policy must be one of"):
        simulate(make_dag(1), "fastest")
