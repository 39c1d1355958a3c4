"""Offline rotation of the residual stream and the online block Hadamards of rotated sites.

QuaRot (Ashkboos et al. 2024, §3) / SpinQuant: an orthogonal Q applied to the residual stream leaves a
pre-norm Llama unchanged once RMSNorm scales are folded into the linears that read the norm (rms(hQ) =
rms(h)), and spreads outlier channels over all channels, which makes per-tensor INT8 activations cheap.
Offline: embedding E·Q; readers (q/k/v, gate/up, lm_head) W·diag(g)·Q; writers (o, down) Qᵀ·W. Online
(quantization time only, `ONLINE_BLOCK`): the input of `o_in` (per head) and `down_in` is multiplied by
a block-diagonal Hadamard T before it is quantized and the site's weights by T (T = Tᵀ = T⁻¹), a fixed
matmul in the static graph. Q = diag(±1)·(R ⊗ H_b) with H_b the largest Hadamard dividing the size.

Gemma 3's post-norms (RMSNorm of o and down, with their own scales, before the residual add) do not commute
with a residual rotation: RMSNorm(x)·diag(g)·Q is not RMSNorm(x·Q)·diag(g'), so Q could only be applied
after each post-norm, a dense float [hidden, hidden] matmul twice a layer. Such a model is rotated per
site instead (`site_rotated`): its weights stay as trained and attn_in and ffn_in become online sites too
(x·T after the RMSNorm, in the graph, like o_in and down_in). The pre-norms' scales are not folded into the
linears: Gemma 3's reach 122 (and 0) in a channel, and folded they leave a column per output row that sets
its INT8 scale (perplexity x30). Its default recipe scales attn_in and down_in per row
(`methods.Recipe.for_config`). Measured on Gemma 3 270M: docs/journal.md, "Issue 39 item 2: moved from docs/design.md"
and "Issue 41 item 4: a scale per row on Gemma 3".
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hetero.errors import ConfigError
from hetero.paths import cache_dir, cached
from hetero.tensorfile import LazyTensors, map_tensors, write_tensors

if TYPE_CHECKING:
    import torch


ROTATION_VERSION = 1  # part of a rotated model's fingerprint (calibration and graph caches)
ONLINE_BLOCK = 64  # Hadamard block of the online sites (one head of 64 on o_in)


def hadamard(n: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of size n (a power of two) scaled to be orthogonal, float64."""
    import torch

    if n < 1 or n & (n - 1):
        raise ConfigError(f"a Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def random_orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    """A Haar-random orthogonal n×n matrix (QR of a Gaussian with the signs of R's diagonal), float64."""
    import torch

    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).contiguous()


def residual_rotation(n: int, seed: int = 0) -> torch.Tensor:
    """Orthogonal [n, n] float64: diag(random signs)·(R_a ⊗ H_b), b the largest power of two dividing n, a = n/b,
    R_a Haar-random (every output channel mixes every input channel)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    b = n & -n
    q = torch.kron(random_orthogonal(n // b, gen), hadamard(b))
    signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1
    return signs[:, None] * q


def site_rotated(cfg) -> bool:
    """Whether the model is rotated per site (post-norms: see the module doc) rather than in its residual stream."""
    return bool(cfg.post_norms)


def online_sites(cfg) -> dict[str, int]:
    """site → Hadamard block of the online transforms this model takes (o_in per head, down_in; a site-rotated
    model also attn_in and ffn_in, and o_in in 64-blocks of a longer head)."""
    out = {}
    site = site_rotated(cfg)
    if cfg.head_dim == ONLINE_BLOCK or (site and cfg.head_dim % ONLINE_BLOCK == 0):
        out["o_in"] = ONLINE_BLOCK
    if cfg.ffn % ONLINE_BLOCK == 0:
        out["down_in"] = ONLINE_BLOCK
    if site and cfg.hidden % ONLINE_BLOCK == 0:
        out["attn_in"] = out["ffn_in"] = ONLINE_BLOCK
    return out


def block_hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """x·T on the last dim, T = diag(H_block, …, H_block): the online transform (and, on a weight [out, in],
    the weight's counterpart W·T, so that (x·T)(W·T)ᵀ = x·Wᵀ)."""
    n = x.shape[-1]
    h = _hadamard_as(block, x.dtype)
    return (x.reshape(*x.shape[:-1], n // block, block) @ h).reshape(x.shape)


@functools.lru_cache(maxsize=None)
def _hadamard_as(n: int, dtype: torch.dtype) -> torch.Tensor:
    """`hadamard(n)` in `dtype`, built once (a decode step applies it ~20 times; read only)."""
    return hadamard(n).to(dtype)


def rotate_weights(cfg, w, seed: int = 0):
    """Weights of the rotated model (same architecture, RMSNorm scales 1): its float output equals `w`'s.
    A site-rotated model (`site_rotated`) keeps `w`: the online transforms of `online_sites` rotate its sites."""
    from hetero.loader import weights_of
    from hetero.weights import weight_arrays

    from hetero.loader import FloatTensors

    if site_rotated(cfg):
        return w
    arrays = weight_arrays(w)
    kept = {k: v for k, v in arrays.items() if k.startswith("layers.") and not _stored(k)}
    return weights_of(cfg, rotated_tensors(cfg, FloatTensors.of(arrays), seed).arrays() | kept)


_FIELDS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down", "bq", "bk", "bv", "bo", "b_down")
_READ = {"wq": "attn_norm", "wk": "attn_norm", "wv": "attn_norm", "w_gate": "ffn_norm", "w_up": "ffn_norm"}  # → norm


ROWS = 4096  # rows of the embedding or the head rotated at a time (whole, each is 1.6 GB at 3B width, the head's
# scaled copy as much again); a row's product does not depend on the others (the same bytes: tests)


def rotated_tensors(cfg, w, seed: int = 0, source: object = "the rotated copy") -> LazyTensors:
    """The tensors rotation changes (`_stored`), each made from `w` (`loader.FloatTensors`: the model's float
    weights, a tensor at a time, from its cache file or straight from its GGUF) when it is asked for, so that the
    rotated copy is written a tensor (the embedding and the head: `ROWS` rows) at a time (at 1B width it is 6 GB of
    float32): embedding E·Q; readers (q/k/v, gate/up, lm_head) W·diag(g)·Q; writers (o, down, and their biases)
    Qᵀ·W; the folded norms 1. The pages of the mapped files read are given back as it goes (`w.pages`).
    ModelFormatError naming a tensor that comes out with a NaN or an infinity."""
    import torch

    from hetero.loader import check_tensor

    q = residual_rotation(cfg.hidden, seed).float()
    shapes = {k: v for k, v in w.shapes.items() if _stored(k)}

    def tensor(name: str, rows: slice | None = None) -> "torch.Tensor":
        return torch.from_numpy(w.get(name, rows))

    def made(name: str, src: "torch.Tensor", out: "torch.Tensor") -> np.ndarray:
        a = out.numpy()
        check_tensor(name, a, a.shape, source)
        if out is not src:
            w.pages.add(src)
        return a

    def pieces(put) -> None:
        for name in sorted(shapes):  # the file's order: written front to back
            field = name.split(".")[-1]
            layer = f"layers.{name.split('.')[1]}." if name.startswith("layers.") else ""
            with torch.inference_mode():
                if name in ("tok_emb", "lm_head"):  # E·Q, and the head (W·diag(g))·Q, a block of rows at a time
                    norm = tensor("norm")
                    for lo in range(0, shapes[name][0], ROWS):
                        rows = tensor(name, slice(lo, lo + ROWS))
                        put(name, made(name, rows, (rows if name == "tok_emb" else rows * norm) @ q))
                    continue
                src = tensor(name)
                if field in ("norm", "attn_norm", "ffn_norm"):  # one tensor each (safetensors stores no shared tensors)
                    out = torch.ones(cfg.hidden)
                elif field in _READ:  # W·diag(g)·Q
                    out = (src * tensor(layer + _READ[field])) @ q
                elif field in ("wo", "w_down"):  # Qᵀ·W
                    out = q.T @ src
                elif field in ("bo", "b_down"):  # biases of the linears writing the residual stream rotate with it
                    out = src @ q
                else:  # those reading it do not
                    out = src
                put(name, made(name, src, out))
        w.pages.flush()

    return LazyTensors(shapes, pieces=pieces, what="rotate")


def _stored(name: str) -> bool:
    """Whether the rotated weights' file holds array `name` (`Model.arrays`'s names): what rotation changes."""
    return name in ("tok_emb", "norm", "lm_head") or name.split(".")[-1] in _FIELDS


def _load(path: Path) -> dict[str, np.ndarray]:
    """The rotated weights in `path`, mapped (no copy, no torch)."""
    arrays, _ = map_tensors(path)
    if not {"tok_emb", "norm", "lm_head"} <= set(arrays):
        raise ValueError("it lacks tok_emb, norm or lm_head")
    return arrays


def rotate_model(model, seed: int = 0, cache: bool = True):
    """The rotated copy of a loaded `Model`, with its own fingerprint (calibrations and graphs are its own);
    its weights are cached beside the model's (`cache_dir()/models/<fingerprint>/weights.safetensors`), written
    one tensor at a time (`rotated_tensors`), mapped and checked against their content record at their first use
    (`paths.cached`: damaged → recomputed with a warning). The layer fields rotation leaves as they are (QK norms,
    gate/up biases) are the model's."""
    from hetero.loader import weights_of

    model.config.check_quantizable("rotation")
    fp = f"{model.fingerprint}-{'site' if site_rotated(model.config) else 'rot'}{ROTATION_VERSION}s{seed}"
    if site_rotated(model.config):  # its weights are the model's (`rotate_weights`): nothing to cache
        return dataclasses.replace(model, fingerprint=fp, rotated=True)

    def build() -> LazyTensors:
        return rotated_tensors(model.config, model.float_tensors(), seed, f"the rotated copy of {model.name}")

    if not cache:
        return model.with_weights(weights_of(model.config, build().arrays() | _kept(model)), fingerprint=fp,
                                  rotated=True)

    def arrays() -> dict[str, np.ndarray]:
        def own() -> dict[str, np.ndarray] | LazyTensors:
            return cached(cache_dir() / "models" / fp, "weights.safetensors", _load, build, write_tensors,
                          "rotated weights")

        got = own()
        if isinstance(got, LazyTensors):  # just written: map the file (or, a cache that cannot take it, make them)
            got = own()
        return (got.arrays() if isinstance(got, LazyTensors) else got) | _kept(model)

    rotated = model.with_weights(lambda: weights_of(model.config, rotated.arrays()), arrays=arrays, fingerprint=fp,
                                 rotated=True)
    return rotated


def _kept(model) -> dict[str, np.ndarray]:
    """The model's arrays that rotation keeps (its QK norms, gate/up biases); read only if it has any (the default
    model has none)."""
    from hetero.loader import fields_used

    if all(f in _FIELDS for f in fields_used(model.config)):
        return {}
    return {k: v for k, v in model.arrays().items() if k.startswith("layers.") and not _stored(k)}
