"""A token tree's verification computes each row exactly as a one-row step of its token does.

Greedy output with speculation changed with the machine's load: the helper thread's heads (`twocore.attnpool`)
ran another compiled copy of the attention kernel than the one-thread step, and under fastmath LLVM optimized the
two copies differently, so a step's logits depended on which thread took which head, and the tree shapes (and so
the rows stepped together) on measured timings. Every caller now runs the kernel's one C entry (`rowattn.attend`).
These tests run on the real default model under a busy second core, compare bits (never a tolerance), and check
the helper's side directly as well, since which thread claims a head is up to the OS.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hetero.decode.rowattn import decode_rows, entry, rope_rows, tree_layout
from hetero.decode.step import DecodeStep
from hetero.decode.tree import TokenTree
from hetero.decode.twocore.attnpool import AttentionPool, _claim_heads
from hetero.rope import RopeTable

PROMPT = "Write a short poem about the sea."


@pytest.fixture
def busy_core():
    """Another process spinning on one core for the test's duration."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    spin.kill()
    spin.wait()


@pytest.mark.parametrize("slot", [37, 300, 1000])
def test_the_helpers_heads_are_the_one_thread_steps_at_the_default_models_shapes(default_model, slot) -> None:
    """The helper's side (`_claim_heads` with helper=True, the compiled loop the helper thread runs) against the
    one-thread step (`decode_rows`) at the default model's head shapes, for every tree size: equal bits. Run on this
    thread, so every head goes through the helper's code path whatever the OS schedules."""
    cfg = default_model.config
    gen = np.random.default_rng(slot)
    g, capacity = cfg.n_heads // cfg.n_kv_heads, slot + 16
    shape = (cfg.n_kv_heads, capacity, cfg.head_dim)
    for n in (1, 2, 4, 8):
        k, v = (gen.standard_normal(shape, np.float32) for _ in range(2))
        tree = TokenTree.chain(list(range(n))) if n < 4 else TokenTree(list(range(n)), [-1] + [0] * (n - 1))
        layout = tree_layout(tree.depth, tree.parents, slot, RopeTable(cfg, capacity))
        qkv = gen.standard_normal((n, cfg.q_dim + 2 * cfg.kv_dim), np.float32)
        want = np.zeros((n, cfg.q_dim), np.float32)
        decode_rows(cfg, qkv, k, v, layout, want)
        q = np.zeros((n, cfg.n_kv_heads, g, cfg.head_dim), np.float32)
        rope_rows(cfg, qkv, k, v, layout, q)
        out = np.zeros((n, cfg.q_dim), np.float32)
        pool = AttentionPool()
        _claim_heads(pool.ctrl, cfg.n_kv_heads, q, k, v, slot, layout.extra, layout.n_extra, cfg.scale,
                     out.reshape(q.shape), True, 0, 0, entry())
        assert pool.helped == cfg.n_kv_heads and np.array_equal(out, want), n


def _one_row_logits(rt, step: DecodeStep, ids: list[int], path: list[int]) -> np.ndarray:
    """The logits of each token of `path` stepped one row at a time after a fresh prefill of ids."""
    cache = rt.prefill(ids).cache
    rows = []
    for tok in path:
        rows.append(step.forward(cache, TokenTree([tok], [-1]))[0])
        cache.advance(1)  # keep the row's K/V, as an accepted token
    return np.stack(rows)


@pytest.mark.slow
def test_a_tree_verification_is_one_row_steps_bit_for_bit_under_a_busy_core(default_model, busy_core) -> None:
    """The default method's decode step (what `hetero run` decodes with) verifies a branching token tree, with its
    helper thread and without, ten times each while another process keeps a core busy: every row's logits equal
    those of the one-row steps along its path, bit for bit. Where the step is not row-exact (MatMulNBits, no
    VNNI) speculation is off by default (`generate.speculation`), so the INT8 graphs' step is checked instead."""
    from hetero.decode.generate import speculation
    from hetero.methods import make_runtime

    rt = make_runtime(default_model)
    tok = default_model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    small_rows = None if DecodeStep.of(rt).row_unexact() is None else 0
    if small_rows == 0:
        assert speculation(DecodeStep.of(rt), "auto") == "off"
    # plain greedy's first tokens, and a tree: that path (depth 4) with a wrong branch at depth 1 and 2
    plain = [int(np.argmax(rt.prefill(ids).logits))]
    cache = rt.prefill(ids).cache
    one = DecodeStep(rt, attention_threads=1, small_rows=small_rows)
    for _ in range(4):
        plain.append(int(np.argmax(one.forward(cache, TokenTree([plain[-1]], [-1]))[0])))
        cache.advance(1)
    tree = TokenTree(plain[:5] + [plain[1] + 1, plain[2] + 1], [-1, 0, 1, 2, 3, 0, 1])
    paths = {4: plain[:5], 5: [plain[0], plain[1] + 1], 6: [plain[0], plain[1], plain[2] + 1]}
    want = np.zeros((len(tree), default_model.config.vocab), np.float32)
    for leaf, path in paths.items():
        rows = _one_row_logits(rt, one, ids, path)
        node, nodes = leaf, []
        while node >= 0:
            nodes.append(node)
            node = tree.parents[node]
        want[nodes[::-1]] = rows
    for threads in (2, 1):
        step = DecodeStep(rt, attention_threads=threads, small_rows=small_rows)
        assert step.row_unexact() is None
        for _ in range(10):
            cache = rt.prefill(ids).cache
            got = step.forward(cache, tree)
            assert np.array_equal(got, want), (threads, np.abs(got - want).max())
        step.close()
    one.close()


_ATTEND_ONCE = """
import sys
import numpy as np
from hetero.decode import rowattn
rng = np.random.default_rng(0)
g, n_kv, d, prefix, rows = 3, 3, 64, 300, 2
k, v = (rng.standard_normal((n_kv, 400, d), dtype=np.float32) for _ in range(2))
q = 3 * rng.standard_normal((rows, n_kv, g, d), dtype=np.float32)
extra, n_extra = np.zeros((rows, 1), np.int64), np.array([0, 1], np.int64)
extra[1, 0] = prefix
out = np.empty((rows, n_kv, g, d), np.float32)
rowattn.attend(rowattn.entry(), q, k, v, prefix, extra, n_extra, 0.125, out, 0, n_kv, 0, 0)
np.save(sys.argv[1], out)
"""


@pytest.mark.slow
def test_a_cold_compile_and_a_cached_load_of_the_kernel_give_the_same_bits(tmp_path) -> None:
    """The first process after an install (numba compiles the kernel) and every later one (numba loads its cached
    object code) decode the same logits: under fastmath the two rounded differently (`jitcache.cfunc`)."""
    import os

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    outs = []
    for run in ("cold", "cached"):
        subprocess.run([sys.executable, "-c", _ATTEND_ONCE, str(tmp_path / f"{run}.npy")], env=env, check=True,
                       timeout=600)
        outs.append(np.load(tmp_path / f"{run}.npy"))
    assert np.isfinite(outs[0]).all() and np.array_equal(outs[0].view(np.int32), outs[1].view(np.int32))
