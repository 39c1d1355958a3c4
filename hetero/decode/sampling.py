"""Choosing tokens from logits: greedy, or temperature / top-k / top-p sampling with a seeded generator.

Sampling is keyed by position: the token at output position i is drawn from p by inverse CDF with the i-th
uniform of numpy's PCG64 stream seeded with `SamplingParams.seed` (`Draws`), whatever was drafted. Verifying
deterministic proposals (lookup, self and model drafts: one-hot draft distributions) then draws that token and
keeps the proposal that equals it (`accept_or_resample`): a proposal x is kept with probability p(x), as in
Leviathan et al. 2023, every emitted token is distributed exactly as p, and a seed gives the same tokens with
speculation on or off and for any tree shape. The rule it replaced (drop a rejected proposal, draw
again from the renormalised rest) drew a varying number of uniforms per token, so the tokens after the first
rejection followed the tree shapes, which follow the machine's load.

numpy throughout (a decode imports no torch): greedy is the first maximal logit (as torch.argmax).
"""

from __future__ import annotations

import numpy as np

from hetero.decode.params import SamplingParams


class Draws:
    """The uniforms of one decode, one per output position, from PCG64 seeded with `seed` (fresh OS entropy when
    None): `draws[i]` is the i-th value of the stream whatever order positions are asked in."""

    def __init__(self, seed: int | None):
        self._gen = np.random.Generator(np.random.PCG64(seed))
        self._u: list[float] = []

    def __getitem__(self, position: int) -> float:
        while len(self._u) <= position:
            self._u.extend(self._gen.random(64).tolist())
        return self._u[position]


def make_generator(params: SamplingParams) -> Draws | None:
    """The decode's uniforms (`Draws`) from `params.seed`; None when greedy."""
    if params.greedy:
        return None
    return Draws(params.seed)


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from: softmax(logits / T) restricted to top-k, then top-p ([vocab] float64)."""
    x = np.asarray(logits, np.float64) / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = np.partition(x, -params.top_k)[-params.top_k]  # the k-th largest: ties with it stay, as torch.topk's mask
        kept = np.flatnonzero(x >= kth)
        e = np.exp(x[kept] - x[kept].max())
        p = np.zeros_like(x)
        p[kept] = _nucleus(e / e.sum(), params.top_p) if params.top_p < 1.0 else e / e.sum()
        return p
    e = np.exp(x - x.max())
    p = e / e.sum()
    return _nucleus(p, params.top_p) if params.top_p < 1.0 else p


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """p restricted to the smallest set of likeliest tokens whose mass reaches top_p (ties: the lower id first),
    renormalised. The set is found among the k likeliest (k = 64, 256, ...: a partition, not a sort of the whole
    vocabulary, which cost ~12 ms a token at 49k)."""
    k = 64
    while True:
        if k >= len(p):
            idx = np.argsort(-p, kind="stable")
        else:
            idx = np.sort(np.argpartition(-p, k)[:k])
            idx = idx[np.argsort(-p[idx], kind="stable")]
        sp = p[idx]
        c = np.cumsum(sp)
        if k >= len(p) or c[-1] >= top_p:
            break
        k *= 4
    keep = c - sp < top_p  # keep the smallest prefix whose mass reaches top_p
    out = np.zeros_like(p)
    out[idx[keep]] = sp[keep]
    return out / out.sum()


def _draw(p: np.ndarray, u: float) -> int:
    """The index whose cumulative mass first exceeds u·sum(p) (probability p[i] / sum(p); never one of zero mass)."""
    c = np.cumsum(p)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return i if i < len(p) else int(np.flatnonzero(p)[-1])  # u·total rounded up to total: the last with mass


def choose(logits: np.ndarray, params: SamplingParams, draws: Draws | None, position: int = 0) -> int:
    """The token at output position `position` from logits [vocab]."""
    if params.greedy:
        return int(np.argmax(logits))
    return _draw(probabilities(logits, params), draws[position])


def accept_or_resample(logits: np.ndarray, candidates: list[int], params: SamplingParams,
                       draws: Draws | None, position: int = 0) -> tuple[int, int | None]:
    """Verify proposed children of one node whose token goes to output position `position`: (the emitted token,
    index of the candidate equal to it or None). Greedy: the argmax. Sampling: the position's draw (`choose`)."""
    tok = choose(logits, params, draws, position)
    return tok, candidates.index(tok) if tok in candidates else None
