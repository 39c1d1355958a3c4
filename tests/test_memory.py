"""Memory: weights read once are handed back, the NPU lane keeps only its shadows' INT8 weights."""

from __future__ import annotations

import pytest
import torch

from bench.machine_bound import attention_flops, linear_ops_per_token, machine_bound
from hetero.loader import load_model, release_pages
from hetero.weights import SITE_LINEARS
from tests.conftest import make_tiny_model


def test_release_pages_of_a_cached_weight_keeps_its_values(default_model) -> None:
    model = load_model()  # the second load maps the model cache's file
    w = model.weights.layers[3].w_up
    before = w.sum().item()
    assert release_pages(w) > w.numel() * w.element_size() // 2
    assert w.sum().item() == before  # faulted back from the file


def test_release_pages_leaves_memory_that_is_not_a_clean_file_mapping() -> None:
    t = torch.randn(1 << 16)
    before = t.clone()
    assert release_pages(t) == 0 and torch.equal(t, before)


def test_npu_backend_keeps_only_shadow_weights() -> None:
    from hetero.npu.graph_backend import NpuBackend
    from tests.npu.conftest import SHADOWS, tiny_plan

    tiny = make_tiny_model()
    plan = tiny_plan(tiny, SHADOWS, scale=0.03)
    be = NpuBackend(tiny, plan, 16)
    kept = {k for k in be.plan.weights}
    assert kept and kept < set(plan.weights)
    site_of = {n: site for site, names in SITE_LINEARS.items() for n in names}
    assert all(plan.sites[(layer, site_of[name])].shadow for layer, name in kept)


def test_bound_counts_and_rates() -> None:
    cfg = make_tiny_model().config
    per_layer = cfg.hidden * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * cfg.hidden + 3 * cfg.hidden * cfg.ffn
    assert linear_ops_per_token(cfg) == 2 * per_layer * cfg.n_layers
    assert attention_flops(cfg, 2) == 4 * cfg.n_heads * cfg.head_dim * 3 * cfg.n_layers
    b = machine_bound(cfg, [8, 32], threads=1, shapes=[(16, cfg.hidden, 2 * cfg.ffn), (32, 32, 32)])
    assert set(b["gemm_ops_per_s"]) == {"int8", "float32", "bfloat16"}
    assert all(set(by) == {f"16x{cfg.hidden}x{2 * cfg.ffn}", "32x32x32"} for by in b["gemm_ops_per_s"].values())
    best = b["best_ops_per_s"]
    assert b["linear_ops_per_s"] == max(best.values()) and b["linear_precision"] in best
    assert b["attention_flop_per_s"] == max(best["float32"], best["bfloat16"])  # attention: a float rate, never int8
    assert [p["prompt_len"] for p in b["per_len"]] == [8, 32]
    for p in b["per_len"]:  # the bound is the counted work at those rates
        n = p["prompt_len"]
        seconds = n * linear_ops_per_token(cfg) / b["linear_ops_per_s"] + attention_flops(cfg, n) / b["attention_flop_per_s"]
        assert p["bound_tokens_per_s"] == pytest.approx(n / seconds, rel=1e-2)


@pytest.mark.slow
def test_memory_worker_reports_stages_and_counts(default_model) -> None:
    from bench.memory import markdown, run_worker
    from hetero.native import gemv, gguf_forms

    r = run_worker("hetero", None, [16, 32], threads=1, decode=3)
    assert [s["stage"] for s in r["stages"]] == ["libraries", "model (mapped)", "plan + runtime (ORT sessions)",
                                                 "prefill 16", "prefill 32", "decode 3"]
    peaks = [s["peak"] for s in r["stages"]]
    assert peaks == sorted(peaks) and all(s["RssAnon"] > 0 and s["RssFile"] > 0 for s in r["stages"])
    cfg, got = default_model.config, r["exact"]
    assert got["kv_cache_32_mb"] == round(2 * cfg.n_layers * cfg.kv_dim * 32 * 4 / 2**20, 1)
    assert got["kv_cache_32+3_mb"] == round(2 * cfg.n_layers * cfg.kv_dim * 35 * 4 / 2**20, 1)
    assert 0 < got["int8_weights_kept_on_cpu_mb"] < 50
    assert got["graph_int8_weights_mb"] == round(linear_ops_per_token(cfg) / 2 / 2**20, 1)
    int8_head_mb = cfg.vocab * cfg.hidden / 2**20
    if gguf_forms.unavailable(default_model) is None:  # the file's own Q4_1 / Q8_0 blocks: fewer bytes than INT8
        assert 0 < got["decode-block-weights_mb"] < got["graph_int8_weights_mb"] + int8_head_mb
    elif gemv.unavailable(cfg) is None:  # the decode GEMVs' arena: every linear and the INT8 head
        assert got["decode-gemv-weights_mb"] > got["graph_int8_weights_mb"]
    assert "| prefill 32 |" in markdown({"engines": [r]})


def test_kept_weights_hold_no_view_of_a_mapped_file(default_model) -> None:
    """The shadows' INT8 weights and the decode GEMVs' scales and biases are copies: a view would keep the whole
    cached weights file mapped, with every page the set-up read resident beside the graphs' and the arena's copies."""
    import dataclasses

    import numpy as np

    from hetero.decode.gemv_step import GemvWeights
    from hetero.methods import make_runtime
    from hetero.native import gemv

    def mapped(a: np.ndarray) -> bool:
        while isinstance(a, np.ndarray):
            if isinstance(a, np.memmap):
                return True
            a = a.base
        return False

    model = load_model()
    rt = make_runtime(model)
    try:
        kept = [getattr(w, f.name) for w in rt.backend.plan.weights.values() for f in dataclasses.fields(w)]
        assert kept and not any(mapped(a) for a in kept)
        if gemv.unavailable(model.config) is None:
            g = GemvWeights(model, rt.backend.plan.online)
            assert not any(mapped(p.ws) for p in g.linears.values()) and not any(mapped(b) for b in g.biases.values())
    finally:
        rt.close()


def test_a_prefill_places_only_the_head_of_the_decode_weights(default_model) -> None:
    """A prefill's last token reads the decode step's head only: the layers' decode weights are placed at the first
    decode step, so a process that only prefills never holds them (`gemv_step.StepLinears`)."""
    from hetero.decode.generate import generate
    from hetero.decode.params import SamplingParams
    from hetero.decode.step import DecodeStep
    from hetero.methods import make_runtime
    from hetero.native import gemv
    from hetero.outliers.corpus import prompt_ids

    model = load_model()
    if gemv.unavailable(model.config) is not None:
        pytest.skip(f"no GEMV decode here: {gemv.unavailable(model.config)}")
    rt = make_runtime(model)
    try:
        first = int(rt.prefill(prompt_ids(None, 64)).logits.argmax())
        linears = DecodeStep.of(rt)._gemv_weights().linears
        head_only = linears.nbytes
        assert len(linears.arenas) == 1 and head_only == linears["head"].w.nbytes
        generate(rt, rt.prefill(prompt_ids(None, 64)), SamplingParams(max_new_tokens=2))
        assert len(linears.arenas) == 2 and linears.nbytes > 2 * head_only
        assert int(rt.prefill(prompt_ids(None, 64)).logits.argmax()) == first
    finally:
        rt.close()


def test_a_process_that_only_prefills_loads_no_numba(default_model) -> None:
    """numba and LLVM (68 MB of library pages, and their modules) come with the decode step's attention and helper
    thread, not with its head: a process that only prefills never loads them (`gemv_step`'s module docstring)."""
    import subprocess
    import sys

    code = ("import sys\nfrom hetero.loader import load_model\nfrom hetero.methods import make_runtime\n"
            "from hetero.outliers.corpus import prompt_ids\n"
            "rt = make_runtime(load_model())\nint(rt.prefill(prompt_ids(None, 64)).logits.argmax())\n"
            "print('numba' in sys.modules, 'llvmlite' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"], out.stdout
