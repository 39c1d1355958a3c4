"""Gantt charts of a prefill schedule, real or simulated (mllm-NPU Fig. 13).

Lanes are rows, each subgraph a bar coloured by its chunk (hatched when it is attention); idle time
shows as white gaps and the title states the critical lane's bubble rate, the makespan against the
lower bound, and whether it was simulated on a profile or measured.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from hetero.paths import PROFILES_DIR
from hetero.extras import require
from hetero.schedule import Schedule


def draw_timeline(ax, schedule: Schedule, title: str = "") -> None:
    """Draw `schedule` on a matplotlib Axes: lanes as rows, chunks as colours, idle time blank."""
    require("plots", "drawing a timeline")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    dag = schedule.dag
    cmap = plt.get_cmap("tab20" if dag.n_chunks > 10 else "tab10")
    scale, unit = (1e3, "ms") if schedule.makespan_us >= 1e4 else (1.0, "µs")
    for row, lane in enumerate(dag.lanes):
        li = dag.lanes.index(lane)
        for v in (v for v in range(dag.n_nodes) if dag.lane[v] == li):
            ax.broken_barh([(schedule.start_us[v] / scale, (schedule.end_us[v] - schedule.start_us[v]) / scale)],
                           (row - 0.4, 0.8), facecolors=cmap(dag.chunk[v] % cmap.N), edgecolor="black",
                           linewidth=0.2, hatch="//" if dag.kinds[dag.kind[v]] == "attn" else "")
            width = (schedule.end_us[v] - schedule.start_us[v]) / max(schedule.makespan_us, 1e-9)
            if width >= 0.012:  # label a block with its decoder layer where the label fits inside it
                _, layer, _ = dag.node_info(v)
                ax.text((schedule.start_us[v] + schedule.end_us[v]) / 2 / scale, row, f"L{layer}", ha="center",
                        va="center", fontsize=6, rotation=90 if width < 0.025 else 0,
                        bbox={"facecolor": "white", "alpha": 0.75, "pad": 0.4, "linewidth": 0})
        busy = schedule.busy_us.get(lane, 0.0)
        ax.text(schedule.makespan_us / scale * 1.005, row, f"busy {busy / max(schedule.makespan_us, 1e-9):.0%}",
                va="center", fontsize=8)
    ax.set_yticks(range(len(dag.lanes)), [ln.upper() for ln in dag.lanes])
    ax.set_ylim(len(dag.lanes) - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})")
    kind = f"simulated on {schedule.profile_name}" if schedule.simulated else "measured run"
    ax.set_title(
        f"{title or 'policy ' + schedule.policy} — {kind}: makespan {schedule.makespan_us / scale:.1f} {unit}, "
        f"{schedule.makespan_over_lb:.3f}× lower bound, {schedule.critical_lane} bubble rate "
        f"{schedule.bubble_rate:.1%}, {dag.n_chunks} chunks × C={dag.chunk_len}", fontsize=9)
    handles = [Patch(facecolor=cmap(i % cmap.N), label=f"chunk {i}") for i in range(min(dag.n_chunks, 16))]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="attn"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.06, 1.0), fontsize=7, frameon=False,
              ncol=1 + len(handles) // 9)


def plot_timeline(schedule: Schedule | Sequence[Schedule], path: str | os.PathLike,
                  title: str | Sequence[str] = "") -> Path:
    """Render one schedule (or several, stacked on a shared time axis) as a PNG (matplotlib Agg)."""
    require("plots", "drawing a timeline")
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    scheds = [schedule] if isinstance(schedule, Schedule) else list(schedule)
    titles = [title] * len(scheds) if isinstance(title, str) else list(title)
    rows = [1.2 + 1.1 * len(s.dag.lanes) for s in scheds]  # lanes tall enough for labelled blocks
    fig, axes = plt.subplots(len(scheds), 1, figsize=(13, sum(rows) + 0.4), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": rows})
    for ax, s, t in zip(axes[:, 0], scheds, titles):
        draw_timeline(ax, s, t)
    xmax = max(s.makespan_us for s in scheds) / (1e3 if scheds[0].makespan_us >= 1e4 else 1.0)
    axes[0, 0].set_xlim(0, xmax * 1.07)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline_command(profile_path: str | os.PathLike | None, prompt_len: int, chunk: int, policy: str,
                     out_png: str | os.PathLike, title: str = "") -> Schedule:
    """`hetero timeline`: simulate a prompt of `prompt_len` tokens on a profile and draw it.

    `profile_path` None: the derived Snapdragon 8 Gen 3 profile. Returns the Schedule drawn. (A real
    run's timeline: pass the Schedule that `LaneWorkers.run` returned to `plot_timeline`.)
    """
    from hetero.sched.costs import compiled_prefill_dag
    from hetero.sched.policy import get_policy
    from hetero.sched.profile import load_profile
    from hetero.sched.simulate import simulate

    get_policy(policy)  # ConfigError on a bad name, before any work
    if profile_path is None:
        profile_path = PROFILES_DIR / "snapdragon_8gen3_qwen1.5-1.8b.json"
    profile = load_profile(profile_path)
    sched = simulate(compiled_prefill_dag(profile, prompt_len, chunk), policy)
    plot_timeline(sched, out_png, title or f"{prompt_len} tokens, policy {policy}")
    return sched


def _ms(us: float) -> str:
    return f"{us / 1e3:.1f} ms" if us >= 1e3 else f"{us:.0f} µs"


def summary_text(schedule: Schedule) -> str:
    """A few lines a reader can take in: what ran, how long, how busy each lane was, how far from the
    lower bound (the text beside the Gantt chart)."""
    s, dag = schedule, schedule.dag
    how = f"simulated on profile {s.profile_name}" if s.simulated else "a real run"
    critical = s.critical_lane
    lanes = "; ".join(f"{lane} busy {_ms(s.busy_us.get(lane, 0.0))} ({1 - s.lane_bubble_rate(lane):.0%})"
                      + (", critical" if lane == critical else "") for lane in dag.lanes)
    return "\n".join([
        f"{how}, policy {s.policy}: {dag.n_chunks} chunk(s) of C={dag.chunk_len}, {dag.n_nodes} subgraphs",
        f"  makespan {_ms(s.makespan_us)}, {s.makespan_over_lb:.2f}x the lower bound {_ms(s.lower_bound_us)}",
        f"  lanes: {lanes}",
        f"  bubbles on the critical lane: {s.bubble_rate:.0%}; scheduler {s.decision_us:.1f} µs per subgraph",
    ])
