"""A token tree verified as one chunk equals its branches run one by one (LLMCad §3.2, tree mask)."""

from __future__ import annotations

import numpy as np

from hetero.decode.drafters import LookupDrafter
from hetero.decode.step import DecodeStep
from hetero.decode.tree import TokenTree
from hetero.runtime import Runtime


def test_tree_mask_and_positions() -> None:
    t = TokenTree([5, 6, 7, 8], [-1, 0, 1, 0])  # root → 6 → 7, root → 8
    assert t.depth == [0, 1, 2, 1]
    assert t.positions(10).tolist() == [10, 11, 12, 11]
    assert t.mask().astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    assert t.children(0) == [1, 3]


def test_tree_rows_equal_each_branch_decoded_alone(tiny_model) -> None:
    rt = Runtime(tiny_model, chunk=16)
    step = DecodeStep(rt)
    prompt = np.arange(3, 40)
    tree = TokenTree([9, 20, 21, 30, 31, 32], [-1, 0, 1, 0, 3, 4])  # two branches under the root 9
    r = rt.prefill(prompt)
    got = step.forward(r.cache, tree)
    for branch in ([0, 1, 2], [0, 3, 4, 5]):
        r2 = rt.prefill(prompt)
        want = step.forward(r2.cache, TokenTree.chain([tree.tokens[i] for i in branch]))
        np.testing.assert_allclose(got[branch], want, rtol=1e-4, atol=1e-4)
    # K/V rows of branch 2 sit at slots 3..5; after keep_rows they are the cache's next rows
    r2 = rt.prefill(prompt)
    step.forward(r2.cache, TokenTree.chain([9, 30, 31, 32]))
    start = r.cache.length
    r.cache.keep_rows(start, [0, 3, 4, 5])
    np.testing.assert_allclose(r.cache.k[:, :, start : start + 4], r2.cache.k[:, :, start : start + 4], rtol=1.3e-6,
                               atol=1e-5)  # torch.testing.assert_close's float32 tolerances


def test_lookup_drafts_the_continuation_of_an_earlier_ngram() -> None:
    ctx = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3]
    t = LookupDrafter().draft(ctx, depth=3, size=8)
    assert t.tokens[:4] == [3, 4, 5, 6] and t.is_chain() or t.tokens[1:4] == [4, 5, 6]
    assert t.tokens[0] == 3 and t.parents[0] == -1


def _scan_draft(ids: list[int], depth: int, size: int, n_max: int = 4) -> list[list[int]]:
    """The lookup by scanning the context (the definition the index must reproduce): for each suffix length,
    longest first, the continuations of its earlier occurrences, most recent first, distinct, until there
    are size // depth of them."""
    width, branches = max(1, size // depth), []
    for n in range(min(n_max, len(ids) - 1), 0, -1):
        for s in range(len(ids) - 1 - n, -1, -1):
            cont = ids[s + n : s + n + depth]
            if ids[s : s + n] == ids[-n:] and cont not in branches:
                branches.append(cont)
            if len(branches) >= width:
                return branches
    return branches


def test_lookup_index_drafts_what_a_scan_of_the_context_drafts() -> None:
    """As the context grows token by token (a decode), and for a context that is not a continuation."""
    from hetero.decode.drafters import _trie

    ctx = np.random.default_rng(0).integers(0, 6, 300).tolist()
    drafter = LookupDrafter()
    for end in list(range(2, 300, 7)) + [120]:  # the last one: a shorter context, the index starts over
        for depth, size in ((7, 8), (1, 4), (2, 8)):
            t = drafter.draft(ctx[:end], depth, size)
            want = _trie(ctx[end - 1], _scan_draft(ctx[:end], depth, size), size)
            assert (t.tokens, t.parents) == (want.tokens, want.parents)


def test_cut_keeps_the_shallow_dfs_prefix_as_a_tree() -> None:
    t = TokenTree([5, 6, 7, 8, 9], [-1, 0, 1, 0, 3])  # root → 6 → 7, root → 8 → 9
    c = t.cut(1, 8)
    assert c.tokens == [5, 6, 8] and c.parents == [-1, 0, 0]
    assert t.cut(2, 3).tokens == [5, 6, 7] and t.cut(0, 8).tokens == [5]


def test_controller_keeps_an_acceptance_rate_per_confidence() -> None:
    from hetero.decode.adapt import TreeController

    ctl = TreeController(sizes=(1, 4, 8), step_ms={1: 10.0, 4: 13.0, 8: 18.0})
    for _ in range(20):  # long matches always right, short ones never
        ctl.observe(8, 18.0, 7, 7, 0.0, 0, confidence=3)
        ctl.observe(4, 13.0, 3, 0, 0.0, 0, confidence=1)
    assert ctl.choose(100, confidence=3) == (7, 8)
    assert ctl.choose(100, confidence=1) == (0, 1)


def test_controller_probes_less_often_while_probes_fail() -> None:
    from hetero.decode.adapt import TreeController

    ctl = TreeController(sizes=(1, 4, 8), step_ms={1: 10.0, 4: 13.0, 8: 18.0}, probe_every=4, probe_max=16)
    ctl.alphas[1] = 0.0  # drafts never right: plain steps, and a probe now and then

    def steps_to_probe() -> int:
        for n in range(1, 100):
            depth, size = ctl.choose(100, confidence=1)
            if depth:
                ctl.observe(size, 13.0, depth, 0, 0.0, 0, confidence=1)  # the probe fails
                ctl.alphas[1] = 0.0
                return n
            ctl.observe(1, 10.0, 0, 0, 0.0, 0, confidence=1)
        return 0

    assert [steps_to_probe() for _ in range(5)] == [4, 8, 16, 16, 16]
    assert [ctl.choose(100, confidence=1) for _ in range(16)][-1] == (2, 4)
    ctl.observe(4, 13.0, 2, 1, 0.0, 0, confidence=1)  # an accepted probe: back to every 4 steps
    ctl.alphas[1] = 0.0
    assert steps_to_probe() == 4


def test_controller_verifies_no_deeper_than_the_draft_and_new_classes_start_from_what_was_seen() -> None:
    """A depth-1 draft is never verified as a deeper chunk (probes included), and a confidence class not tried
    yet starts from the acceptance seen over all classes, not the optimistic prior (open chat: drafts never
    right, so a new class is not verified at all)."""
    from hetero.decode.adapt import TreeController

    ctl = TreeController(sizes=(1, 2, 4, 8), step_ms={1: 10.0, 2: 12.0, 4: 15.0, 8: 22.0}, probe_every=2)
    assert ctl.choose(100, confidence=5, depth=1) == (1, 2)  # the 0.6 prior pays at depth 1, capped there
    for _ in range(10):
        ctl.observe(2, 12.0, 1, 0, 0.0, 0, confidence=1)  # class 1 never right
    assert ctl.alpha_all < 0.2
    # new classes 2, 3, 4 start near 0.06: plain steps, and every second call a probe (probe_every=2), depth 1
    assert [ctl.choose(100, confidence=c, depth=1) for c in (2, 3, 4, 1)] == [(0, 1), (1, 2), (0, 1), (1, 2)]
    assert ctl.choose(100, confidence=9) == (0, 1)  # a new class with no depth cap: no deep tree on the prior
