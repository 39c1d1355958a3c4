"""The benchmark says when its numbers cannot be trusted; its plots draw the repeats."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.conditions import trust_warnings
from bench.plots import engine_style, plot_ablation, plot_speed
from bench.report import markdown

COMMITTED = Path(__file__).resolve().parents[1] / "bench" / "results" / "prefill.json"


def _row(engine, runs, simulated=False):
    med = sorted(runs)[len(runs) // 2]
    return {"engine": engine, "prompt_len": 256, "tokens_per_s": 256 / (med / 1e3), "ttft_ms": med,
            "peak_rss_mb": 0.0, "simulated": simulated, "runs_ms": runs, "note": ""}


def test_loaded_machine_and_noisy_repeats_are_flagged():
    quiet = [_row("hetero", [100.0, 101.0, 102.0])]
    assert trust_warnings(quiet, 0.3, 0.5, cpus=2) == []
    loaded = trust_warnings(quiet, 6.0, 9.5, cpus=2)
    assert len(loaded) == 1 and "load average 6.0 at the start, 9.5 at the end, on 2 CPUs" in loaded[0]
    noisy = trust_warnings([_row("torch_float", [100.0, 180.0, 120.0])], 0.2, 0.2, cpus=2)
    assert noisy == ["torch_float at 256 tokens: repeats spread 67% (100-180 ms)"]


def test_warnings_reach_the_report_and_the_plots(tmp_path):
    result = json.loads(COMMITTED.read_text())
    result["warnings"] = trust_warnings(result["rows"], 8.0, 8.0, cpus=2)
    assert markdown(result).splitlines()[2].startswith("**Warning: the machine was loaded")
    plot_speed(result, tmp_path / "speed.png")
    plot_ablation(result, tmp_path / "ablation.png")
    assert (tmp_path / "speed.png").stat().st_size > 10_000 and (tmp_path / "ablation.png").stat().st_size > 10_000


def test_one_colour_and_name_per_engine():
    assert engine_style("hetero") == ("tab:red", "hetero (INT8 graphs + shadow, laid out by this host's placement)")
    assert engine_style("hetero_lanes")[0] != engine_style("hetero")[0]
    assert engine_style("some_new_engine") == engine_style("some_new_engine")
    assert engine_style("some_new_engine")[1] == "some new engine"


def test_a_measured_process_peak_is_its_own_not_its_parents():
    """A child started by subprocess (vfork + exec) inherits its parent's high-water mark in `ru_maxrss`; the peak
    the benches report (VmHWM, polled for `scale.run_measured`) is the child's own."""
    import sys

    import numpy as np

    from bench.conditions import peak_rss_mb
    from bench.scale import run_measured

    big = np.ones(400 << 17)  # 400 MB touched: this process's high-water mark is at least that
    del big
    code = "import numpy as np, time; a = np.ones(64 << 17); time.sleep(0.3)"  # 64 MB
    _, peak, _ = run_measured([sys.executable, "-c", code], dict(os.environ))
    assert peak_rss_mb() > 400 and 64 < peak < 300
