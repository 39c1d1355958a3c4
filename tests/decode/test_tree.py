"""A token tree verified as one chunk equals its branches run one by one (LLMCad §3.2, tree mask)."""

from __future__ import annotations

import torch

from hetero.decode.drafters import LookupDrafter
from hetero.decode.step import DecodeStep
from hetero.decode.tree import TokenTree
from hetero.runtime import Runtime


def test_tree_mask_and_positions() -> None:
    t = TokenTree([5, 6, 7, 8], [-1, 0, 1, 0])  # root → 6 → 7, root → 8
    assert t.depth == [0, 1, 2, 1]
    assert t.positions(10).tolist() == [10, 11, 12, 11]
    assert t.mask().int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    assert t.children(0) == [1, 3]


def test_tree_rows_equal_each_branch_decoded_alone(tiny_model) -> None:
    rt = Runtime(tiny_model, chunk=16)
    step = DecodeStep(rt)
    prompt = torch.arange(3, 40)
    tree = TokenTree([9, 20, 21, 30, 31, 32], [-1, 0, 1, 0, 3, 4])  # two branches under the root 9
    r = rt.prefill(prompt)
    got = step.forward(r.cache, tree)
    for branch in ([0, 1, 2], [0, 3, 4, 5]):
        r2 = rt.prefill(prompt)
        want = step.forward(r2.cache, TokenTree.chain([tree.tokens[i] for i in branch]))
        torch.testing.assert_close(got[branch], want, rtol=1e-4, atol=1e-4)
    # K/V rows of branch 2 sit at slots 3..5; after keep_rows they are the cache's next rows
    r2 = rt.prefill(prompt)
    step.forward(r2.cache, TokenTree.chain([9, 30, 31, 32]))
    start = r.cache.length
    r.cache.keep_rows(start, [0, 3, 4, 5])
    torch.testing.assert_close(r.cache.k[:, :, start : start + 4], r2.cache.k[:, :, start : start + 4])


def test_lookup_drafts_the_continuation_of_an_earlier_ngram() -> None:
    ctx = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3]
    t = LookupDrafter().draft(ctx, depth=3, size=8)
    assert t.tokens[:4] == [3, 4, 5, 6] and t.is_chain() or t.tokens[1:4] == [4, 5, 6]
    assert t.tokens[0] == 3 and t.parents[0] == -1


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
