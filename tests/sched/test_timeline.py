from hetero.sched.executor import execute
from hetero.sched.simulate import simulate
from hetero.sched.timeline import plot_timeline, timeline_command


def test_plot_simulated_and_real(tmp_path, make_dag):
    dag = make_dag(3)
    for name, sched in [("sim", simulate(dag, "eq6")), ("real", execute(dag, "rank", lambda v: None))]:
        png = plot_timeline(sched, tmp_path / f"{name}.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_command_on_the_derived_profile(tmp_path):
    sched = timeline_command(None, 1024, 256, "rank", tmp_path / "t.png")
    assert sched.simulated and sched.dag.n_chunks == 4 and (tmp_path / "t.png").stat().st_size > 1000
