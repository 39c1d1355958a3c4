"""Chunked prefill equals one full forward; continuation equals prefilling the concatenation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero.chunking import plan_chunks
from hetero.model import forward
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model


def assert_prefill_equals_full(model, ids: torch.Tensor, chunk: int) -> None:
    n = ids.numel()
    logits, k, v = forward(model.config, model.weights, ids)
    rt = Runtime(model, chunk=chunk)
    cache = rt.new_cache()
    cache.k.fill(float("nan"))  # anything written past the prompt would show up as non-NaN
    cache.v.fill(float("nan"))
    r = rt.prefill(ids, cache=cache)
    assert r.cache.length == n and r.n_tokens == n and r.start == 0
    assert len(r.chunk_ms) == -(-n // chunk)
    torch.testing.assert_close(r.logits, logits[-1].numpy(), atol=1e-4, rtol=0)
    torch.testing.assert_close(r.cache.k[:, :, :n], k.numpy(), atol=1e-4, rtol=0)
    torch.testing.assert_close(r.cache.v[:, :, :n], v.numpy(), atol=1e-4, rtol=0)
    assert np.isnan(r.cache.k[:, :, n:]).all(), "padding leaked into the cache"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 3 * 16 + 17])
def test_tiny_chunked_equals_full(arch: str, n: int) -> None:
    model = make_tiny_model(arch)
    ids = torch.randint(0, model.config.vocab, (n,), generator=torch.Generator().manual_seed(n))
    assert_prefill_equals_full(model, ids, chunk=16)


@pytest.mark.parametrize("n_fn", [lambda c: 1, lambda c: c - 1, lambda c: c, lambda c: c + 1, lambda c: 3 * c + 17])
def test_real_model_chunked_equals_full(default_model, real_text_ids, n_fn) -> None:
    chunk = 64
    assert_prefill_equals_full(default_model, real_text_ids[: n_fn(chunk)], chunk)


def test_real_model_default_chunk_256(default_model, real_text_ids) -> None:
    assert_prefill_equals_full(default_model, real_text_ids[: 256 + 17], 256)


@pytest.mark.parametrize("split", [1, 20, 32, 50])
def test_continuation_equals_concatenation(default_model, real_text_ids, split: int) -> None:
    ids = real_text_ids[:83]
    rt = Runtime(default_model, chunk=32)
    first = rt.prefill(ids[:split])
    second = rt.prefill(ids[split:], cache=first.cache)
    assert second.start == split and second.cache.length == 83
    whole = Runtime(default_model, chunk=32).prefill(ids)
    torch.testing.assert_close(second.logits, whole.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(second.cache.k[:, :, :83], whole.cache.k[:, :, :83], atol=1e-4, rtol=0)


@pytest.mark.parametrize("n, rows", [(1, [16]), (64, [64]), (300, [160, 144]), (513, [176, 176, 176]),
                                     (1024, [256] * 4)])
def test_any_rows_chunks_are_near_equal_and_aligned(n: int, rows: list[int]) -> None:
    chunks = plan_chunks(n, 256, start=5, any_rows=True)
    assert [c.rows for c in chunks] == rows and sum(c.n_valid for c in chunks) == n
    assert [c.start for c in chunks] == [5 + sum(c.n_valid for c in chunks[:i]) for i in range(len(chunks))]
    assert all(c.n_valid <= c.rows for c in chunks)


def test_fixed_rows_backend_pads_to_c(tiny_model) -> None:
    ids = torch.randint(0, tiny_model.config.vocab, (40,), generator=torch.Generator().manual_seed(2))
    fixed = Runtime(tiny_model, chunk=32)
    fixed.backend.any_rows = False  # as fixed-shape graphs
    assert [c.rows for c in fixed.plan(ids).chunks] == [32, 32]
    torch.testing.assert_close(fixed.prefill(ids).logits, Runtime(tiny_model, chunk=32).prefill(ids).logits,
                               atol=1e-5, rtol=0)


def test_the_backend_owns_its_node_kinds(tiny_model) -> None:
    """The runtime takes the kinds from the backend: a placement naming a kind the backend does not run, or a chunk
    length other than its fixed-shape graphs' rows, is refused when they meet."""
    from hetero.errors import ConfigError
    from hetero.npu.nodes import LAYER_PLACEMENT
    from hetero.runtime import SerialExecutor
    from hetero.torch_backends import FloatBackend

    with pytest.raises(ConfigError, match="kinds \\['layer'\\]"):
        Runtime(tiny_model, chunk=16, executor=SerialExecutor(tiny_model.config.n_layers, LAYER_PLACEMENT))
    fixed = FloatBackend(tiny_model.config, tiny_model.weights)
    fixed.any_rows, fixed.chunk = False, 32  # as fixed-shape graphs of 32 rows
    with pytest.raises(ConfigError, match="chunk length 16 differs from the 32 rows"):
        Runtime(tiny_model, chunk=16, backend=fixed)
    assert Runtime(tiny_model, chunk=32, backend=fixed).reads_kv == {"attn"}


def test_cache_grows_when_capacity_is_small(tiny_model) -> None:
    ids = torch.arange(40) % tiny_model.config.vocab
    rt = Runtime(tiny_model, chunk=16)
    cache = rt.new_cache(capacity=8)
    r = rt.prefill(ids[:30], cache=cache)
    r = rt.prefill(ids[30:], cache=r.cache)
    full = rt.prefill(ids)
    assert r.cache.length == 40 and r.cache.capacity >= 40
    torch.testing.assert_close(r.logits, full.logits, atol=1e-5, rtol=0)


def test_writes_go_into_preallocated_buffer(tiny_model) -> None:
    """No concat, no reallocation: the cache's storage is the one allocated before the prefill."""
    rt = Runtime(tiny_model, chunk=16)
    cache = rt.new_cache()
    ptr = cache.k.ctypes.data
    rt.prefill(torch.arange(50) % 256, cache=cache)
    assert cache.k.ctypes.data == ptr and cache.length == 50
