"""The rotated float model equals the float model."""

from __future__ import annotations

import pytest
import torch

from hetero import model as ref
from hetero.errors import ConfigError
from hetero.outliers.rotate import block_hadamard, hadamard, online_sites, residual_rotation, rotate_model
from tests.conftest import make_tiny_model


@pytest.mark.parametrize("n", [64, 576, 96, 5])
def test_residual_rotation_is_orthogonal_and_mixes_every_channel(n):
    q = residual_rotation(n, seed=3)
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=q.dtype), atol=1e-12)
    assert bool((q != 0).all()) or n == 5  # dense (n = 5 is odd: a random orthogonal, dense almost surely)
    assert not torch.equal(q, residual_rotation(n, seed=4))


def test_block_hadamard_is_its_own_inverse_and_keeps_products():
    x, w = torch.randn(5, 256, dtype=torch.float64), torch.randn(3, 256, dtype=torch.float64)
    assert torch.allclose(block_hadamard(block_hadamard(x, 64), 64), x, atol=1e-12)
    assert torch.allclose(block_hadamard(x, 64) @ block_hadamard(w, 64).T, x @ w.T, atol=1e-10)
    with pytest.raises(ConfigError, match="power of two"):
        hadamard(48)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rotated_tiny_model_equals_float(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE", str(tmp_path))
    m = make_tiny_model(arch)
    r = rotate_model(m, seed=1)
    again = rotate_model(m, seed=1)  # from the cache
    assert torch.equal(again.weights.layers[1].w_down, r.weights.layers[1].w_down)
    assert r.fingerprint != m.fingerprint and torch.equal(r.weights.layers[0].attn_norm, torch.ones(64))
    assert r.rotated and not m.rotated  # a flag on the model, not a guess from the fingerprint's text
    ids = torch.arange(40) % m.config.vocab
    a, ka, va = ref.forward(m.config, m.weights, ids)
    b, kb, vb = ref.forward(r.config, r.weights, ids)
    assert float((a - b).abs().max()) < 1e-4
    # the KV cache is the float model's: a decoder engine can continue from it with the original weights
    assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)
    assert online_sites(m.config) == {"down_in": 64}  # head_dim 16: no per-head Hadamard on o_in



def test_the_embedding_and_head_rotated_a_block_of_rows_at_a_time_are_the_same_bytes(monkeypatch):
    import numpy as np

    from hetero.outliers import rotate

    m = make_tiny_model(seed=2)
    whole = rotate.rotated_tensors(m.config, m.float_tensors(), 1).arrays()
    monkeypatch.setattr(rotate, "ROWS", 48)  # 256 rows: 6 blocks, the last one short
    blocks = rotate.rotated_tensors(m.config, m.float_tensors(), 1).arrays()
    assert whole.keys() == blocks.keys() and {"tok_emb", "lm_head"} <= whole.keys()
    assert all(np.array_equal(whole[k], blocks[k]) for k in whole)

def test_rotation_is_the_models_flag_not_its_fingerprint():
    """A fingerprint that happens to contain "-rot" is no rotation; quant_plan refuses a recipe that disagrees."""
    import dataclasses

    from hetero.methods import ROTATED, W8A8, quant_plan

    m = dataclasses.replace(make_tiny_model(), fingerprint="tiny-rotten")
    assert not m.rotated
    with pytest.raises(ConfigError, match="is not rotated"):
        quant_plan(m, recipe=ROTATED)
    with pytest.raises(ConfigError, match="is rotated"):
        quant_plan(dataclasses.replace(m, rotated=True), recipe=W8A8)


@pytest.mark.slow
def test_rotated_default_model_equals_float(default_model, real_text_ids):
    m = default_model
    r = rotate_model(m)
    assert online_sites(m.config) == {"o_in": 64, "down_in": 64}
    ids = real_text_ids[:256]
    a = ref.forward(m.config, m.weights, ids)[0]
    b = ref.forward(r.config, r.weights, ids)[0]
    assert float((a - b).abs().max()) < 1e-3


def test_the_online_blocks_are_part_of_the_rotation_version():
    """A rotated model's calibration observes its online transforms (x·T), and its fingerprint keys that calibration:
    a different block with the same ROTATION_VERSION would read scales measured in the other block's domain, a silent
    wrong answer. Changing a block needs a version bump, and this pin with it."""
    from hetero.outliers.rotate import ROTATION_VERSION

    import dataclasses

    plain = make_tiny_model(head_dim=64).config
    post_norms = dataclasses.replace(plain, post_norms=True)
    pins = {1: ({"o_in": 64, "down_in": 64}, {"o_in": 64, "down_in": 64, "attn_in": 64, "ffn_in": 64})}
    assert (online_sites(plain), online_sites(post_norms)) == pins[ROTATION_VERSION]
