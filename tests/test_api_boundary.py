"""The Python API at its edge: token ids and caches validated with a ConfigError; cache ownership
(`prefill(cache=c)` extends c in place, `KVCache.fork()` keeps a state)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hetero
from hetero.errors import ConfigError
from hetero.runtime import Runtime
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def rt():
    return Runtime(make_tiny_model(), chunk=16)


IDS = [5, 17, 200, 3, 9, 44, 101]


@pytest.mark.parametrize("ids", [np.array(IDS, dtype=np.uint16), np.array(IDS, dtype=np.int32),
                                 np.array(IDS, dtype=np.uint8), torch.tensor(IDS, dtype=torch.int16),
                                 torch.tensor(IDS, dtype=torch.uint16), tuple(IDS), range(5, 12),
                                 [np.int64(i) for i in IDS]])
def test_sensible_ids_are_accepted(rt, ids):
    ref = rt.prefill(torch.tensor(list(ids))).logits
    assert np.array_equal(rt.prefill(ids).logits, ref)


@pytest.mark.parametrize("ids, message", [
    ([10**30], r"token id 10{30} at index 0 is out of range \[0, 256\)"),
    (np.array([1, 2**16 - 1], dtype=np.uint16), "token id 65535 at index 1 is out of range"),
    (np.array([1, 2**63 + 5], dtype=np.uint64), "out of range"),
    (None, "got NoneType"),
    ("hello", "got str: tokenize the text first"),
    (b"hello", "got bytes"),
    ((i for i in IDS), r"got generator \(materialize it: list\(ids\)\)"),
    ({1, 2}, "got set"),
    ([1, 2.5], "element 1 is float"),
    ([1, True], "element 1 is bool"),
    (np.array([1.0, 2.0]), "dtype float64"),
    (torch.tensor([True, False]), "dtype torch.bool"),
    ([], "ids is empty"),
    ([[1, 2], [3, 4]], r"ids must be 1-D token ids \[n\], got a list of 2 list\(s\)"),
    (np.zeros((2, 3), dtype=np.int64), r"ids must be 1-D token ids \[n\], got shape \(2, 3\)"),
    # a batch of one too (the API takes one prompt's 1-D ids), with what to pass instead
    (np.array([IDS]), r"ids must be 1-D token ids \[n\], got shape \(1, 7\): pass one prompt's ids, ids\[0\]"),
    (torch.tensor([IDS]), r"got shape \(1, 7\)"),
    ([IDS], r"got a list of 1 list\(s\): pass one prompt's ids, ids\[0\]"),
])
def test_bad_ids_are_config_errors(rt, ids, message):
    with pytest.raises(ConfigError, match=message):
        rt.prefill(ids)


def test_cache_of_another_runtime_is_rejected_before_running(rt):
    other = Runtime(make_tiny_model(n_layers=3), chunk=16)
    with pytest.raises(ConfigError, match="cache is from another model or runtime: 3 layers"):
        rt.prefill(IDS, cache=other.new_cache())
    half = rt.new_cache()
    half.k, half.v = np.zeros_like(half.k, np.float16), np.zeros_like(half.v, np.float16)
    with pytest.raises(ConfigError, match="float16, this runtime needs .* float32"):
        rt.prefill(IDS, cache=half)
    for bad in ({}, [], "cache"):
        with pytest.raises(ConfigError, match="cache must be a hetero.KVCache"):
            rt.prefill(IDS, cache=bad)


def test_prefill_extends_the_cache_in_place_and_fork_keeps_a_state(rt):
    first = rt.prefill(IDS)
    saved = first.cache.fork()
    more = rt.prefill([7, 8, 9], cache=first.cache)  # documented: extends first.cache in place
    assert more.cache is first.cache and first.cache.length == len(IDS) + 3
    assert saved.length == len(IDS)
    k0, _ = saved.keys_values(1)
    assert np.array_equal(k0, first.cache.keys_values(1)[0][:, : len(IDS)])
    # the fork continues independently, and both branches give what one long prefill gives
    branch = rt.prefill([7, 8, 9], cache=saved)
    assert np.allclose(branch.logits, more.logits, atol=1e-5)
    assert np.allclose(rt.prefill(IDS + [7, 8, 9]).logits, more.logits, atol=1e-4)


def test_make_runtime_is_exported():
    assert hetero.make_runtime.__name__ == "make_runtime"
    assert "make_runtime" in hetero.__all__
