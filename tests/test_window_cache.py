"""A sliding-window layer keeps only its window (`KVCache.place`) and still computes what transformers computes.

Tiny models (`tests.tiny_hf`) at prompts several windows long: the chunked prefill (C = 64 and 256, the chunk
attention over rows that hold positions base..), decoding past the window (one row, token trees), the INT8 graphs
and the bound decode step, with the real headroom (`kv_cache.ROOM`) and with one row of headroom (a windowed
layer moves its window back to row 0 at nearly every write). A cache that lost the positions a request would read
refuses it (ConfigError) instead of answering wrongly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero import kv_cache
from hetero.errors import ConfigError
from hetero.loader import load_model
from hetero.runtime import Runtime
from tests.tiny_hf import build, greedy, logits

# (id, arch, config fields): a window on every layer; Gemma 3's windowed + global layers with a local RoPE base;
# Phi-3's partial rotary with a window on heads ONNX Runtime's kernel cannot rotate (`model.attention` runs them)
WINDOWED = [
    ("mistral", "mistral", {"sliding_window": 7}),
    ("gemma3", "gemma3", {}),
    ("phi3-partial-small-window", "phi3", {"partial_rotary_factor": 0.5, "sliding_window": 11}),
]


@pytest.fixture(scope="module", params=WINDOWED, ids=[c[0] for c in WINDOWED])
def pair(request, tmp_path_factory):
    name, arch, fields = request.param
    path = tmp_path_factory.mktemp(name)
    hf = build(arch, path, **fields)
    return hf, load_model(path)


@pytest.fixture(params=[kv_cache.ROOM, 1], ids=["room", "room-1"])
def room(request, monkeypatch):
    monkeypatch.setattr(kv_cache, "ROOM", request.param)
    return request.param


def _windowed(cfg) -> list[int]:
    return [i for i, w in enumerate(cfg.windows) if w]


def test_prefill_past_the_window_keeps_only_it(pair, room) -> None:
    """T = 300 (25 or more windows): the last logits within 1e-4 of transformers at C = 64 and 256; a windowed
    layer's rows start past position 0 and the cache holds less than a full-history one."""
    hf, model = pair
    cfg = model.config
    ids = torch.randint(0, cfg.vocab, (300,), generator=torch.Generator().manual_seed(3))
    theirs = logits(hf, ids)[-1]
    for c in (64, 256):
        rt = Runtime(model, chunk=c)
        res = rt.prefill(ids)
        assert np.abs(res.logits - theirs.numpy()).max() < 1e-4, c
        full = rt.prefill(ids, rt.new_cache(full_history=True))
        assert np.abs(full.logits - theirs.numpy()).max() < 1e-4, c
        for layer in _windowed(cfg):  # moved: positions before its window are gone
            assert res.cache.base(layer) > 0 and res.cache.base(layer) <= 300 - cfg.window(layer) + 1
            assert full.cache.base(layer) == 0
        assert res.cache.held_bytes() < full.cache.held_bytes()
        if room == 1:  # at most its window + a chunk
            w = max(cfg.windows)
            assert max(res.cache._high[i] for i in _windowed(cfg)) <= w - 1 + c


def test_decode_and_trees_past_the_window_match_transformers(pair, room) -> None:
    """Greedy decoding that runs past the window (a 20-token prompt, 24 tokens: one-row steps, then lookup
    speculation's token trees over a repeated text) emits transformers' tokens."""
    from hetero.decode.generate import generate
    from hetero.decode.params import SamplingParams

    hf, model = pair
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, model.config.vocab, (20,), generator=g)
    rt = Runtime(model, chunk=64)
    params = SamplingParams(max_new_tokens=24, stop_token_ids=())
    gen = generate(rt, rt.prefill(ids), params, speculate="off")
    assert list(gen.tokens) == greedy(hf, ids, 24)
    repeat = torch.cat([ids, ids[:12], ids[:12]])  # lookup drafts from the repeated text: trees past the window
    # a fixed tree (depth 7 in 8 rows): the adaptive choice depends on measured step costs (a cached profile may
    # say drafting does not pay, and nothing would be drafted)
    spec = generate(rt, rt.prefill(repeat), params, speculate="lookup", context_ids=repeat.tolist(), tree=(7, 8))
    assert list(spec.tokens) == greedy(hf, repeat, 24) and spec.drafted > 0


def test_a_cache_refuses_what_its_window_dropped(tmp_path, monkeypatch) -> None:
    """Roll-backs and reads past a windowed layer's kept positions are refused; fork, write_span and an abandoned
    prefill keep the rule (continuing equals a fresh prefill, or is refused)."""
    monkeypatch.setattr(kv_cache, "ROOM", 1)
    build("mistral", tmp_path, sliding_window=7)
    model = load_model(tmp_path)
    rt = Runtime(model, chunk=16)
    ids = torch.randint(3, model.config.vocab, (100,), generator=torch.Generator().manual_seed(2))
    want = rt.prefill(ids).logits
    cache = rt.prefill(ids[:60]).cache
    assert cache.base(0) > 0 and cache.resumable(60) and cache.resumable(54) and not cache.resumable(30)
    with pytest.raises(ConfigError, match="roll back"):
        cache.truncate(30)
    with pytest.raises(ConfigError, match="full_history"):
        cache.read_span(0, 16)
    with pytest.raises(ConfigError, match="full_history"):
        cache.keys_values(0)
    twin = cache.fork()
    assert np.array_equal(rt.prefill(ids[60:], twin).logits, rt.prefill(ids[60:], cache).logits)
    assert twin.length == cache.length == 100
    assert np.abs(rt.prefill(ids[60:], rt.prefill(ids[:60]).cache).logits - want).max() < 1e-5
    # a restore of positions [0, 60) from a full-history cache: the windowed layers keep its last W - 1
    full = rt.prefill(ids[:60], rt.new_cache(full_history=True)).cache
    k, v = full.read_span(0, 60)
    restored = rt.new_cache()
    restored.write_span(0, k, v)
    assert restored.base(0) > 0 and np.abs(rt.prefill(ids[60:], restored).logits - want).max() < 1e-5
    # an abandoned prefill (closed after a few slices) moved the windows past what continuing needs: refused
    cache = rt.prefill(ids[:20]).cache
    steps = rt.prefill_steps(ids[20:], cache, slice_s=0.0, contended=lambda: True)
    while cache.resumable(20):
        next(steps)
    steps.close()
    assert cache.length == 20
    with pytest.raises(ConfigError, match="gone"):
        rt.prefill(ids[20:], cache)


def test_int8_graphs_and_bound_step_keep_only_the_window(tmp_path, monkeypatch) -> None:
    """The INT8 graphs (Mistral, window 7, one row of headroom): a prefill 9 windows long equals the full-history
    cache's to float rounding, the bound decode step on two threads (`AttentionPool`, the base with each job) equals
    it on one bit for bit, and its greedy tokens (one row, and lookup trees) equal the full-history cache's."""
    from hetero.decode.generate import generate
    from hetero.decode.params import SamplingParams
    from hetero.decode.step import DecodeStep
    from hetero.decode.tree import TokenTree
    from hetero.npu.graph_backend import NpuBackend
    from tests.npu.conftest import SHADOWS, tiny_plan

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kv_cache, "ROOM", 1)
    build("mistral", tmp_path / "hf", sliding_window=7)
    m = load_model(tmp_path / "hf")
    rt = Runtime(m, chunk=16, backend=NpuBackend(m, tiny_plan(m, SHADOWS), 16, provider="cpu"))
    prompt = torch.arange(3, 66) * 5 % m.config.vocab
    got, full = rt.prefill(prompt), rt.prefill(prompt, rt.new_cache(full_history=True))
    assert got.cache.base(0) > 0 and full.cache.base(0) == 0
    assert np.abs(got.logits - full.logits).max() < 1e-4
    one, two = DecodeStep(rt, attention_threads=1), DecodeStep(rt, attention_threads=2, split_after=0)
    for tree in (TokenTree([7], [-1]), TokenTree([7, 9, 4, 2], [-1, 0, 0, 1])):  # the helper's heads: the same bits
        a, b = rt.prefill(prompt).cache, rt.prefill(prompt).cache
        assert a.base(0) > 0 and np.array_equal(one.forward(a, tree), two.forward(b, tree))
    two.close()
    params = SamplingParams(max_new_tokens=16, stop_token_ids=())
    for speculate in ("off", "lookup"):
        a = generate(rt, rt.prefill(prompt), params, speculate=speculate, context_ids=prompt.tolist())
        b = generate(rt, rt.prefill(prompt, rt.new_cache(full_history=True)), params, speculate=speculate,
                     context_ids=prompt.tolist())
        assert list(a.tokens) == list(b.tokens) and len(a.tokens) == 16


def test_whole_layer_graphs_keep_only_the_window(tmp_path, monkeypatch) -> None:
    """The whole-layer graphs (`GraphOptions.fused`: GroupQueryAttention inside, bound from `base` on with the RoPE
    table's rows from `base`) over a windowed model (Mistral, window 7, one row of headroom): the logits equal the
    segments' prefill to float rounding, and a full-history cache's."""
    from hetero.npu.nodes import LAYER_PLACEMENT
    from hetero.npu.graph_backend import GraphOptions, NpuBackend
    from hetero.runtime import SerialExecutor
    from hetero.sched.wavefront import WavefrontExecutor
    from tests.npu.conftest import SHADOWS, tiny_plan

    monkeypatch.setenv("HETERO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kv_cache, "ROOM", 1)
    build("mistral", tmp_path / "hf", sliding_window=7)
    m = load_model(tmp_path / "hf")
    plan = tiny_plan(m, SHADOWS)
    fused = Runtime(m, chunk=16, backend=NpuBackend(m, plan, 16, options=GraphOptions(fused=True)),
                    executor=SerialExecutor(m.config.n_layers, LAYER_PLACEMENT))
    segments = Runtime(m, chunk=16, backend=NpuBackend(m, plan, 16))
    prompt = torch.arange(3, 70) * 7 % m.config.vocab
    got = fused.prefill(prompt)
    assert got.cache.base(0) > 0
    assert np.abs(got.logits - segments.prefill(prompt).logits).max() < 1e-4
    # the same chunks on two lanes (`sched.wavefront`): each layer's rows still move in chunk order, bit for bit
    wave = Runtime(m, chunk=16, backend=fused.backend, executor=WavefrontExecutor(m.config.n_layers, LAYER_PLACEMENT))
    assert np.array_equal(wave.prefill(prompt).logits, got.logits)
    assert np.abs(got.logits - fused.prefill(prompt, fused.new_cache(full_history=True)).logits).max() < 1e-4
