"""Drafters: cheap guesses of the next tokens, as a token tree the target verifies in one chunk.

- `LookupDrafter`: prompt lookup, n-grams of the context (no extra model): the tokens that followed
  earlier occurrences of the context's last n tokens; distinct continuations become sibling branches.
- `ModelDrafter`: a draft model (any model hetero loads, sharing the target's tokenizer) decoding a
  chain on its own cache; a runner-up token above `branch_p` starts a sibling (LLMCad §3.2).
- `SelfDrafter`: self-speculation, the target's first layers + its head as the draft model; their K/V go
  to the rows the verification overwrites.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from hetero.decode.tree import TokenTree
from hetero.errors import ConfigError


class Drafter(Protocol):
    name: str

    def draft(self, context: list[int], depth: int, size: int) -> TokenTree:
        """A tree of at most `size` nodes and `depth` levels under context[-1] (the root)."""
        ...

    def accepted(self, context: list[int]) -> None:
        """The verified context after a step (its last token is the next root)."""
        ...


def _trie(root: int, branches: list[list[int]], size: int) -> TokenTree:
    """Merge branches (best first) into a tree in DFS order, best branch leading, at most `size` nodes."""
    tokens, parents = [root], [-1]
    kids: dict[tuple[int, int], int] = {}
    for br in branches:
        node = 0
        for t in br:
            nxt = kids.get((node, t))
            if nxt is None:
                if len(tokens) >= size:
                    break
                nxt = kids[(node, t)] = len(tokens)
                tokens.append(t)
                parents.append(node)
            node = nxt
    # re-order into DFS (a later branch may hang under an early node)
    order: list[int] = []
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], 1):
        children.setdefault(p, []).append(i)
    stack = [0]
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(reversed(children.get(i, [])))
    new = {old: k for k, old in enumerate(order)}
    return TokenTree([tokens[i] for i in order], [-1 if parents[i] < 0 else new[parents[i]] for i in order])


class LookupDrafter:
    """Prompt lookup: continuations of the longest recent n-gram match (n from `n_max` down to `n_min`).

    Drafting costs nothing next to a target step (`free`), so the decoder drafts the deepest tree and the
    controller decides how much of it to verify from `confidence`, the matched length (capped at 3): on
    `bench/decode.py`'s tasks a 1-token match is right a quarter of the time, a 4-token match almost
    always. No match: the root alone, a plain step. The n-grams of the context are indexed as it grows
    (a decode's context only grows), so a draft looks its suffixes up instead of scanning the context
    (a scan of a 200-token chat cost ~0.24 ms a step, 3% of a plain step).
    """

    name = "lookup"
    free = True

    def __init__(self, n_max: int = 4, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ConfigError(f"lookup n-gram lengths must satisfy 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_max, self.n_min = n_max, n_min
        self.confidence = 0  # matched length of the last draft (0: none), capped at 3
        self._ids: list[int] = []  # the context indexed so far
        self._starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its start positions, ascending

    def _index(self, context: list[int]) -> None:
        """Index every n-gram that lies in context[:-1] (a match must be followed by a token)."""
        known = len(self._ids)
        if len(context) < known or context[:known] != self._ids:  # another context: start over
            self._ids, self._starts, known = [], {}, 0
        self._ids = list(context)
        for end in range(max(known - 1, 0) + 1, len(context)):  # windows ending at end-1 <= len - 2
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._starts.setdefault(tuple(context[end - n : end]), []).append(end - n)

    def draft(self, context: list[int], depth: int, size: int) -> TokenTree:
        branches: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        width = max(1, size // max(depth, 1))
        self.confidence = 0
        if depth > 0:
            self._index(context)
            for n in range(min(self.n_max, len(context) - 1), self.n_min - 1, -1):
                for s in reversed(self._starts.get(tuple(context[-n:]), ())):  # most recent first
                    cont = tuple(context[s + n : s + n + depth])
                    if cont not in seen:
                        seen.add(cont)
                        branches.append(list(cont))
                        self.confidence = self.confidence or min(n, 3)
                    if len(branches) >= width:
                        break
                if len(branches) >= width:
                    break
        return _trie(context[-1], branches, size)

    def accepted(self, context: list[int]) -> None:
        pass


class SelfDrafter:
    """The target's first `layers` layers and its head draft a chain (self-speculation)."""

    name = "self"

    def __init__(self, step, cache, layers: int | None = None):
        n = step.cfg.n_layers
        self.step, self.cache = step, cache
        self.layers = layers or max(1, n // 4)
        if not 0 < self.layers < n:
            raise ConfigError(f"self-speculation layers must be in [1, {n - 1}], got {self.layers}")

    def draft(self, context: list[int], depth: int, size: int) -> TokenTree:
        chain = [context[-1]]
        for i in range(min(depth, size - 1)):
            logits = self.step.forward(self.cache, TokenTree([chain[-1]], [-1]), slot=self.cache.length + i,
                                       layers=self.layers)
            chain.append(int(logits[0].argmax()))
        return TokenTree.chain(chain)

    def accepted(self, context: list[int]) -> None:
        pass


class ModelDrafter:
    """A separate draft model on its own runtime and cache, kept in step with the verified context."""

    name = "draft"

    def __init__(self, runtime, branch_p: float = 0.3):
        from hetero.decode.step import DecodeStep

        self.runtime, self.step = runtime, DecodeStep.of(runtime)
        self.cache = runtime.new_cache()
        self.cached: list[int] = []  # ids whose K/V the draft cache holds
        self.branch_p = branch_p

    def _sync(self, context: list[int]) -> None:
        """Make the draft cache hold exactly context[:-1]."""
        want = context[:-1]
        same = 0
        for a, b in zip(self.cached, want):
            if a != b:
                break
            same += 1
        same = min(same, self.cache.length)
        if not self.cache.resumable(same):  # its windowed layers moved past `same`: start the draft cache over
            self.cache, same = self.runtime.new_cache(), 0
        self.cache.truncate(same)
        self.cached = self.cached[: self.cache.length]
        missing = want[self.cache.length :]
        if len(missing) > 8:
            self.runtime.prefill(missing, cache=self.cache)
        else:
            for t in missing:
                self.step.forward(self.cache, TokenTree([t], [-1]), rows=[])
                self.cache.advance(1)
        self.cached = list(want)

    def draft(self, context: list[int], depth: int, size: int) -> TokenTree:
        self._sync(context)
        tokens, parents = [context[-1]], [-1]
        node = 0
        base = self.cache.length
        for i in range(min(depth, size - 1)):
            logits = self.step.forward(self.cache, TokenTree([tokens[node]], [-1]), slot=base + i)
            self.cache.advance(1)
            self.cached.append(tokens[node])
            best, second, p2 = _top2(logits[0])
            if len(tokens) + 1 < size and p2 > self.branch_p:
                tokens.append(second)  # sibling of the chain's next node (LLMCad branch)
                parents.append(node)
            tokens.append(best)
            parents.append(node)
            node = len(tokens) - 1
        # best child must lead in DFS order: put the chain child before its sibling
        return _trie(tokens[0], _paths(tokens, parents), size)

    def accepted(self, context: list[int]) -> None:
        pass


def _top2(logits: np.ndarray) -> tuple[int, int, float]:
    """The likeliest token (the first maximal logit, as greedy), the runner-up and its softmax probability."""
    x = np.asarray(logits, np.float64)
    best = int(np.argmax(x))
    e = np.exp(x - x[best])
    total = e.sum()
    e[best] = -1.0  # below every probability: the runner-up is the largest of the rest
    second = int(np.argmax(e))
    return best, second, float(e[second] / total)


def _paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Root-to-leaf token paths, the branch through each node's last-added child first."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], 1):
        kids.setdefault(p, []).append(i)
    out: list[list[int]] = []

    def walk(i: int, path: list[int]) -> None:
        ch = kids.get(i, [])
        if not ch:
            out.append(path)
        for c in reversed(ch):
            walk(c, path + [tokens[c]])

    walk(0, [])
    return out
