"""A token tree to verify in one chunk (LLMCad §3.2; SpecInfer's tree attention in one sequence).

Node 0 is the root: the last emitted token, whose K/V is not cached yet. Nodes are laid out in DFS
order with the likeliest child first, so the common accepted path is a prefix of the chunk and its K/V
needs no move. Row i sees row j iff j is i or an ancestor of i; siblings share a position (depth).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class TokenTree:
    tokens: list[int]
    parents: list[int]  # -1 for the root
    depth: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.depth:
            self.depth = [0 if p < 0 else 0 for p in self.parents]
            for i, p in enumerate(self.parents):
                if i and not 0 <= p < i:
                    raise ValueError(f"tree node {i}: parent {p} must come before it")
                self.depth[i] = 0 if p < 0 else self.depth[p] + 1

    @classmethod
    def chain(cls, tokens: list[int]) -> "TokenTree":
        return cls(list(tokens), [-1] + list(range(len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, i: int) -> list[int]:
        return [j for j in range(i + 1, len(self.parents)) if self.parents[j] == i]

    def positions(self, start: int) -> np.ndarray:
        """[n] int64: each row's position (siblings share one)."""
        return np.asarray(self.depth, np.int64) + start

    def mask(self) -> np.ndarray:
        """[n, n] bool: row i sees itself and its ancestors."""
        n = len(self.tokens)
        m = np.zeros((n, n), np.bool_)
        for i, p in enumerate(self.parents):
            if p >= 0:
                m[i] = m[p]
            m[i, i] = True
        return m

    def cut(self, depth: int, size: int) -> "TokenTree":
        """The first `size` nodes (DFS order) of depth <= `depth`: parents precede children, so a tree."""
        keep = [i for i, d in enumerate(self.depth) if d <= depth][:size]
        new = {old: k for k, old in enumerate(keep)}
        return TokenTree([self.tokens[i] for i in keep], [-1 if self.parents[i] < 0 else new[self.parents[i]] for i in keep])

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))
