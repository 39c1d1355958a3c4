"""Decoding on hetero's own KV cache: `stream` (an iterator of tokens) and `generate` (all at once).

Each target step feeds the last emitted token (the root) plus, with speculation, a drafted token tree
as one chunk (LLMCad §3.2): every row's K/V is written in place, the longest accepted path stays (moved
to the front if needed), the rest is forgotten. Greedy speculation emits exactly plain greedy's tokens;
seeded sampling draws each output position's token with that position's uniform, so it emits the same tokens
with or without speculation (`sampling.accept_or_resample`). The cache invariant
(docs/design.md, "Invariants"): after a decode, `cache.length` = prompt + all generated tokens but the last.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Sequence

from hetero.decode.adapt import TreeController
from hetero.decode.drafters import Drafter, LookupDrafter, ModelDrafter, SelfDrafter
from hetero.decode.params import Generation, SamplingParams, TokenEvent
from hetero.decode.sampling import accept_or_resample, choose, make_generator
from hetero.decode.step import TREE_SIZES, DecodeStep
from hetero.decode.text import TextStream
from hetero.decode.tree import TokenTree
from hetero.errors import ConfigError
from hetero.runtime import PrefillResult, Runtime

# "auto": lookup where a tree's rows are one-row steps bit for bit (`DecodeStep.row_unexact`), else off
SPECULATE = ("auto", "off", "lookup", "draft", "self")


_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>")
_tokenizer_stops: "weakref.WeakKeyDictionary[object, frozenset[int]]" = weakref.WeakKeyDictionary()


def stop_ids(runtime: Runtime, params: SamplingParams) -> frozenset[int]:
    if params.stop_token_ids is not None:
        return frozenset(params.stop_token_ids)
    ids = {runtime.cfg.eos_token_id}
    tok = runtime.model.tokenizer
    if tok is not None:
        ids |= end_tokens(tok)
    return frozenset(i for i in ids if i is not None)


def end_tokens(tok: object) -> frozenset[int]:
    """The tokenizer's (`hetero.tokenizer.Tokenizer`) end-of-turn ids, once per tokenizer."""
    out = _tokenizer_stops.get(tok)
    if out is None:
        found = [getattr(tok, "eos_token_id", None)] + [tok.token_to_id(name) for name in _END_TOKENS]
        out = _tokenizer_stops[tok] = frozenset(i for i in found if i is not None)
    return out


def speculation(step: DecodeStep, speculate: str) -> str:
    """The speculation a decode runs: "auto" is "lookup" where verifying a tree computes each row as a one-row step
    does, else "off"; a drafter asked for where it is not is refused, since it would change greedy output."""
    if speculate not in SPECULATE:
        raise ConfigError(f"speculate must be one of {', '.join(SPECULATE)}, got {speculate!r}")
    why = step.row_unexact()
    if speculate == "auto":
        return "off" if why else "lookup"
    if speculate != "off" and why:
        raise ConfigError(f"speculate={speculate!r} would change the greedy output here: {why}; use 'auto' or 'off'")
    return speculate


def make_drafter(speculate: str, runtime: Runtime, cache, draft_runtime: Runtime | None) -> Drafter | None:
    if speculate == "off":
        return None
    if speculate == "lookup":
        return LookupDrafter()
    if speculate == "self":
        return SelfDrafter(DecodeStep.of(runtime), cache)
    if draft_runtime is None:
        raise ConfigError("speculate='draft' needs a draft model (--draft-model / draft_runtime=...)")
    if draft_runtime.cfg.vocab != runtime.cfg.vocab:
        raise ConfigError(f"draft model vocabulary {draft_runtime.cfg.vocab} differs from the target's "
                          f"{runtime.cfg.vocab}: they must share the tokenizer")
    return ModelDrafter(draft_runtime)


class Decoding:
    """One decode in progress; iterate it for `TokenEvent`s, then read its counters."""

    def __init__(self, runtime: Runtime, prefill: PrefillResult, params: SamplingParams, speculate: str = "off",
                 context_ids: Sequence[int] | None = None, draft_runtime: Runtime | None = None,
                 tree: tuple[int, int] | None = None):
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be a SamplingParams, got {type(params).__name__}")
        self.runtime, self.params, self.cache = runtime, params, prefill.cache
        self.logits0 = prefill.logits
        self.step = DecodeStep.of(runtime)
        self.speculate = speculation(self.step, speculate)
        self.drafter = make_drafter(self.speculate, runtime, self.cache, draft_runtime)
        self.context = list(context_ids) if context_ids is not None else []
        if context_ids is not None and len(self.context) != self.cache.length:
            raise ConfigError(f"context_ids has {len(self.context)} ids but the cache holds {self.cache.length}")
        self.base = self.cache.length
        self.stops = stop_ids(runtime, params)
        self.text = TextStream(runtime.model.tokenizer, params.stop)
        self.tokens: list[int] = []
        self.finish_reason = "length"
        self.accepted = self.drafted = self.steps = 0
        self.decode_ms = 0.0
        self.control = TreeController(sizes=TREE_SIZES)
        self.fixed_tree = tree  # (depth, size): no adaptation (tests, experiments)
        if tree is not None and not (0 <= tree[0] < tree[1] <= TREE_SIZES[-1]):
            raise ConfigError(f"tree must be (depth, size) with 0 <= depth < size <= {TREE_SIZES[-1]}, got {tree!r}")
        if self.drafter is not None and tree is None:  # LLMCad's cost side: what each tree size costs on this machine
            self.control.step_ms.update(self.step.measure(self.cache))
        self._done = False

    def _emit(self, tok: int) -> TokenEvent:
        self.tokens.append(tok)
        p = self.params
        if tok in self.stops:
            self._done, self.finish_reason = True, "stop"
        elif len(self.tokens) >= p.max_new_tokens:
            self._done = True
        delta = self.text.push(self.tokens, final=self._done)
        if self.text.stopped:
            self._done, self.finish_reason = True, "stop"
        return TokenEvent(tok, delta, len(self.tokens) - 1)

    def __iter__(self) -> Iterator[TokenEvent]:
        t0 = time.perf_counter()
        try:
            if self.params.max_new_tokens == 0:
                return
            gen = make_generator(self.params)
            yield self._emit(choose(self.logits0, self.params, gen, 0))
            while not self._done:
                for tok in self._one_step(gen):
                    yield self._emit(tok)
                    if self._done:
                        break
        finally:
            if self.drafter is not None and self.fixed_tree is None:  # a fixed tree's first steps build graphs
                self.step.costs.update(self.control.step_ms)
            # whatever happened (finished, stopped mid-path, closed early): keep the invariant
            self.cache.truncate(min(self.cache.length, self.base + max(len(self.tokens) - 1, 0)))
            self.decode_ms = (time.perf_counter() - t0) * 1e3

    def _one_step(self, gen) -> list[int]:
        """One target pass over the root (+ a drafted tree); returns the tokens it decided."""
        root = self.tokens[-1]
        # a tree's rows are written at positions length.. : no more rows than the context has room for
        room = self.runtime.cfg.context_length - self.cache.length
        budget = min(self.params.max_new_tokens - len(self.tokens), room)
        draft_ms, depth, confidence = 0.0, 0, None
        tree = TokenTree([root], [-1])
        if self.drafter is not None and self.fixed_tree is None and getattr(self.drafter, "free", False):
            # drafting costs nothing: draft the deepest tree, then verify as much of it as pays for its class
            full = self.drafter.draft(self.context + self.tokens, self.control.max_depth, TREE_SIZES[-1])
            confidence = self.drafter.confidence
            if len(full) > 1:
                depth, size = self.control.choose(budget, confidence, max(full.depth))
                tree = full.cut(min(depth, budget - 1), min(size, room))
        elif self.drafter is not None:
            depth, size = self.control.choose(budget) if self.fixed_tree is None else self.fixed_tree
            depth, size = min(depth, budget - 1), min(size, room)
            t = time.perf_counter()
            tree = self.drafter.draft(self.context + self.tokens, depth, size) if depth else tree
            draft_ms = (time.perf_counter() - t) * 1e3
        self.step.prepare(len(tree))  # a size's first use binds its graphs: not part of the step's time
        t = time.perf_counter()
        logits = self.step.forward(self.cache, tree)
        step_ms = (time.perf_counter() - t) * 1e3
        self.steps += 1
        path, node = [0], 0
        while True:
            kids = tree.children(node)
            tok, idx = accept_or_resample(logits[node], [tree.tokens[k] for k in kids], self.params, gen,
                                          len(self.tokens) + len(path) - 1)
            if idx is None:
                break
            node = kids[idx]
            path.append(node)
        self.cache.accept_path(path)
        n_drafted = len(tree) - 1
        self.drafted += max(tree.depth)
        self.accepted += len(path) - 1
        if self.drafter is not None:
            tried = min(max(tree.depth), len(path))
            self.control.observe(self.step.padded_size(len(tree)), step_ms, tried, len(path) - 1, draft_ms,
                                 n_drafted if self.speculate != "lookup" else 0, confidence)
        return [tree.tokens[i] for i in path[1:]] + [tok]

    def result(self) -> Generation:
        n = len(self.tokens)
        tps = n / (self.decode_ms / 1e3) if self.decode_ms > 0 else 0.0
        return Generation(tuple(self.tokens), self.text.text, self.finish_reason, self.cache, self.decode_ms, tps,
                          self.accepted, self.drafted, self.steps)


def stream(runtime: Runtime, prefill: PrefillResult, params: SamplingParams | None = None, *, speculate: str = "off",
           context_ids: Sequence[int] | None = None, draft_runtime: Runtime | None = None,
           tree: tuple[int, int] | None = None) -> Iterator[TokenEvent]:
    """Tokens as they are decoded. Closing the iterator early leaves the cache consistent.

    context_ids: the ids whose K/V the cache holds (the prompt); prompt lookup searches them too.
    tree: a fixed (depth, size) of the drafted trees instead of the adaptive choice.
    """
    d = Decoding(runtime, prefill, params or SamplingParams(), speculate, context_ids, draft_runtime, tree)
    yield from d


def generate(runtime: Runtime, prefill: PrefillResult, params: SamplingParams | None = None, *,
             speculate: str = "off", context_ids: Sequence[int] | None = None,
             draft_runtime: Runtime | None = None, tree: tuple[int, int] | None = None) -> Generation:
    """Decode until a stop token, a stop string or max_new_tokens; see `stream`."""
    d = Decoding(runtime, prefill, params or SamplingParams(), speculate, context_ids, draft_runtime, tree)
    for _ in d:
        pass
    return d.result()
