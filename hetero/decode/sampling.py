"""Choosing tokens from logits: greedy, or temperature / top-k / top-p sampling with a seeded generator.

`accept_or_resample` is the speculative acceptance rule for deterministic proposals (Leviathan et al.
2023 with a one-hot draft distribution; SpecInfer's multi-candidate form for siblings): a proposal x is
kept with probability p(x), otherwise x is removed from p and the next sibling (or a fresh sample from
the renormalised rest) is tried, so every emitted token is distributed exactly as p.
"""

from __future__ import annotations

import torch

from hetero.decode.params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return g


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T) restricted to top-k, then top-p."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, idx = torch.sort(p, descending=True)
        drop = sp.cumsum(-1) - sp >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter_(-1, idx, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


def choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from logits [vocab]."""
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probabilities(logits, params), 1, generator=gen))


def accept_or_resample(logits: torch.Tensor, candidates: list[int], params: SamplingParams,
                       gen: torch.Generator | None) -> tuple[int, int | None]:
    """Verify proposed children of one node: (the emitted token, index of the accepted candidate or None).

    Greedy: the argmax; accepted if it is one of the candidates. Sampling: the rule above.
    """
    if params.greedy:
        tok = int(logits.argmax())
        return tok, candidates.index(tok) if tok in candidates else None
    p = probabilities(logits, params)
    for i, c in enumerate(candidates):
        pc = float(p[c])
        if pc > 0 and float(torch.rand((), generator=gen)) < pc:
            return c, i
        p[c] = 0.0
        total = float(p.sum())
        if total <= 0:  # every token with mass was proposed and rejected: cannot happen unless p is one-hot
            break
        p /= total
    return int(torch.multinomial(p, 1, generator=gen)), None
