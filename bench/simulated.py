"""Simulated rows of the prefill benchmark: hetero's policies and Fig. 17's ablation on a device profile.

Every simulated row names its profile and says "simulated" (discrete-event simulation, `hetero.sched`).
"""

from __future__ import annotations

from typing import Any

from bench.harness import Row
from hetero.paths import PROFILES_DIR
from hetero.sched.costs import build_dag, compile_dag, compiled_prefill_dag
from hetero.sched.profile import Profile, load_profile
from hetero.sched.simulate import simulate

# mllm-NPU §2.3: building a QNN graph for Gemma-2B takes 360 ms and optimizing it 11.54 s; the naive
# engine pays this for every new prompt length. (Gemma-2B's figure stands in for Qwen1.5-1.8B's.)
NAIVE_PREPARE_S = 0.36 + 11.54


def simulated_rows(profile_path: str | None, lens: list[int], chunk: int = 256) -> list[Row]:
    """hetero (rank) and hetero in-order on a device profile: discrete-event simulation, labelled."""
    profile = _profile(profile_path)
    rows = []
    for n in lens:
        for engine, policy in (("hetero", "rank"), ("hetero_in_order", "in_order"), ("hetero_eq6", "eq6")):
            s = simulate(compiled_prefill_dag(profile, n, chunk), policy)
            ms = s.makespan_us / 1e3
            rows.append(Row(engine, n, round(n / (ms / 1e3), 1), round(ms, 2), 0.0, True, [],
                            f"simulated, profile {profile.name}"))
    return rows


def simulated_ablation(profile_path: str | None, n: int = 512, chunk: int = 256) -> list[dict[str, Any]]:
    """Fig. 17's steps on a device profile (simulated): naive → chunk sharing → + shadow → + out-of-order."""
    profile = _profile(profile_path)
    base = profile.layer_subgraphs
    with_shadow = tuple(x for pair in base for x in ([pair, ("shadow", "cpu")] if pair[0] == "qkv" else [pair]))
    c_max = max(profile.chunk_lens)
    # naive: one graph of T rows (per-token cost of the largest profiled C), no overlap, + preparation
    per_layer_ms = sum(profile.cost_us(k, lane, c_max, n) for k, lane in base) * n / c_max / 1e3
    naive_ms = NAIVE_PREPARE_S * 1e3 + per_layer_ms * profile.n_layers
    steps = [("naive NPU", naive_ms)]
    n_chunks = -(-n // chunk)
    for label, layer, policy in (("+ chunk sharing", base, "in_order"), ("+ shadow outliers", with_shadow, "in_order"),
                                 ("+ out-of-order", with_shadow, "rank")):
        dag = compile_dag(build_dag(n_chunks, layer, profile.n_layers), profile, chunk)
        steps.append((label, simulate(dag, policy).makespan_us / 1e3))
    return [{"step": s, "prefill_ms": round(ms, 2), "tokens_per_s": round(n / (ms / 1e3), 1), "simulated": True,
             "profile": profile.name, "prompt_len": n} for s, ms in steps]


def _profile(path: str | None) -> Profile:
    return load_profile(path or PROFILES_DIR / "snapdragon_8gen3_qwen1.5-1.8b.json")


