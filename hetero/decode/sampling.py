"""Choosing tokens from logits: greedy, or temperature / top-k / top-p sampling with a seeded generator.

`accept_or_resample` is the speculative acceptance rule for deterministic proposals (Leviathan et al.
2023 with a one-hot draft distribution; SpecInfer's multi-candidate form for siblings): a proposal x is
kept with probability p(x), otherwise x is removed from p and the next sibling (or a fresh sample from
the renormalised rest) is tried, so every emitted token is distributed exactly as p.

numpy throughout (a decode imports no torch, issue 28): greedy is the first maximal logit (as torch.argmax);
sampling draws from numpy's PCG64 generator seeded with `SamplingParams.seed`: a seed gives the same tokens on
every run, but not those it gave when decoding drew from torch's generator (before issue 28).
"""

from __future__ import annotations

import numpy as np

from hetero.decode.params import SamplingParams


def make_generator(params: SamplingParams) -> np.random.Generator | None:
    """The decode's generator: PCG64 from `params.seed` (fresh OS entropy when None); None when greedy."""
    if params.greedy:
        return None
    return np.random.Generator(np.random.PCG64(params.seed))


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


def _draw(p: np.ndarray, gen: np.random.Generator) -> int:
    """One index drawn with probability p[i] / sum(p) (never one of zero mass)."""
    c = np.cumsum(p)
    i = int(np.searchsorted(c, gen.random() * c[-1], side="right"))
    return i if i < len(p) else int(np.flatnonzero(p)[-1])  # u·total rounded up to total: the last with mass


def choose(logits: np.ndarray, params: SamplingParams, gen: np.random.Generator | None) -> int:
    """One token from logits [vocab]."""
    if params.greedy:
        return int(np.argmax(logits))
    return _draw(probabilities(logits, params), gen)


def accept_or_resample(logits: np.ndarray, candidates: list[int], params: SamplingParams,
                       gen: np.random.Generator | None) -> tuple[int, int | None]:
    """Verify proposed children of one node: (the emitted token, index of the accepted candidate or None).

    Greedy: the argmax; accepted if it is one of the candidates. Sampling: the rule above.
    """
    if params.greedy:
        tok = int(np.argmax(logits))
        return tok, candidates.index(tok) if tok in candidates else None
    p = probabilities(logits, params)
    for i, c in enumerate(candidates):
        pc = float(p[c])
        if pc > 0 and gen.random() < pc:
            return c, i
        p[c] = 0.0
        total = float(p.sum())
        if total <= 0:  # every token with mass was proposed and rejected: cannot happen unless p is one-hot
            break
        p /= total
    return _draw(p, gen), None
