import pytest

from hetero.sched.optimal import solve_optimal
from hetero.schedule import Schedule, check_schedule

pytest.importorskip("ortools")


def test_single_chunk_optimum_is_the_chain(make_dag):
    d = make_dag(1)
    r = solve_optimal(d, time_limit_s=5)
    assert r.proven and r.makespan_us == pytest.approx(sum(d.cost_us))


def test_optimal_schedule_is_valid(make_dag):
    d = make_dag(3)
    r = solve_optimal(d, time_limit_s=5)
    end = tuple(s + c for s, c in zip(r.start_us, d.cost_us))
    s = Schedule("optimal", d, r.start_us, end, max(end), {}, d.lower_bound_us(), 0.0, True)
    check_schedule(s)
    assert s.makespan_us == pytest.approx(r.makespan_us)
    assert r.bound_us <= r.makespan_us + 1e-6
