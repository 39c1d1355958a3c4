"""A prefix index over token ids: chunk-aligned blocks in a trie, each block owning its K/V (Pensieve §4.1).

Every node is one block of at most `block` tokens at absolute positions [start, start + len(ids)); only
full blocks have children, so a partial block is always a leaf (the growing tail of a conversation).
A conversation is a path from the root, and conversations sharing a prefix (a system prompt, earlier
turns of a regenerated reply) share its nodes. Because attention is causal, the first k tokens of any
node are valid K/V for any prompt that matches them, so matching is token-granular over block-aligned
storage. The K/V payload and its tier live on the node (`hetero.serve.store` moves them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from concurrent.futures import Future

    import numpy as np

    from hetero.serve.quant import QTensor

_ids = itertools.count(1)


@dataclass(eq=False, slots=True)
class Node:
    """One block of a conversation's K/V. `ids` never change once the node exists (payloads are immutable)."""

    ids: tuple[int, ...]
    start: int  # absolute position of ids[0]
    parent: "Node | None"
    children: dict[int, list["Node"]] = field(default_factory=dict)  # first token id -> nodes
    k: "np.ndarray | None" = None  # float32 [L, n_kv, n, D], when held in RAM uncompressed
    v: "np.ndarray | None" = None
    qk: "QTensor | None" = None  # compressed in RAM
    qv: "QTensor | None" = None
    disk: Path | None = None  # a complete (clean) copy on disk
    writing: "Future | None" = None  # ahead-of-time write in flight
    lossy: bool = False  # compressed once (`ChunkStore._demote`): its K/V are no longer what was computed
    refs: int = 0  # contexts whose path holds this node
    pins: int = 0  # requests reading or writing it now (never evicted while > 0)
    last_used: float = 0.0
    depth: int = 0
    uid: int = field(default_factory=lambda: next(_ids))

    @property
    def end(self) -> int:
        return self.start + len(self.ids)

    @property
    def tier(self) -> str:
        if self.k is not None:
            return "ram"
        if self.qk is not None:
            return "compressed"
        if self.disk is not None:
            return "disk"
        return "dropped"

    def ram_bytes(self) -> int:
        if self.k is not None:
            return 2 * self.k.nbytes
        if self.qk is not None:
            return self.qk.nbytes + self.qv.nbytes
        return 0


@dataclass(frozen=True, slots=True)
class Match:
    """The cached prefix of a prompt: whole nodes, then the first `partial_len` tokens of `partial`."""

    path: tuple[Node, ...]
    partial: Node | None
    partial_len: int

    @property
    def n_tokens(self) -> int:
        return (self.path[-1].end if self.path else 0) + self.partial_len

    def nodes(self) -> list[tuple[Node, int]]:
        """(node, number of its tokens used), in position order."""
        out = [(n, len(n.ids)) for n in self.path]
        if self.partial is not None and self.partial_len:
            out.append((self.partial, self.partial_len))
        return out


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixIndex:
    """The trie of blocks. Only the store's owner thread mutates it."""

    def __init__(self, block: int):
        self.block = block
        self.root = Node((), 0, None)

    def match(self, ids: list[int], limit: int | None = None) -> Match:
        """The longest cached prefix of `ids` (at most `limit` tokens)."""
        limit = len(ids) if limit is None else min(limit, len(ids))
        node, pos, path = self.root, 0, []
        while pos < limit:
            best, best_n = None, 0
            for c in node.children.get(ids[pos], ()):
                n = _common(c.ids, ids[pos:limit])
                if n > best_n:
                    best, best_n = c, n
            if best is None:
                break
            if best_n == len(best.ids) and len(best.ids) == self.block:
                path.append(best)
                node, pos = best, pos + best_n
                continue
            return Match(tuple(path), best, best_n)
        return Match(tuple(path), None, 0)

    def find_child(self, parent: Node, ids: tuple[int, ...]) -> Node | None:
        for c in parent.children.get(ids[0], ()):
            if c.ids == ids:
                return c
        return None

    def add(self, parent: Node, ids: tuple[int, ...]) -> Node:
        node = Node(ids, parent.end, parent, depth=parent.depth + 1)
        parent.children.setdefault(ids[0], []).append(node)
        return node

    def remove(self, node: Node) -> None:
        """Unlink a leaf that no context or request uses."""
        assert not node.children and node.refs == 0 and node.pins == 0, "removing a node in use"
        siblings = node.parent.children[node.ids[0]]
        siblings.remove(node)
        if not siblings:
            del node.parent.children[node.ids[0]]

    def subsumed(self, node: Node) -> list[Node]:
        """Unused partial siblings whose ids are a strict prefix of `node`'s (their K/V is a prefix of its)."""
        return [s for s in node.parent.children.get(node.ids[0], ()) if s is not node and not s.children
                and s.refs == 0 and s.pins == 0 and len(s.ids) < len(node.ids) and node.ids[: len(s.ids)] == s.ids]

    def walk(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            for group in n.children.values():
                out.extend(group)
                stack.extend(group)
        return out
