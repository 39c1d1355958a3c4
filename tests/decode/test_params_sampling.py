"""SamplingParams validation, the sampling distribution, and the speculative acceptance rule's exactness."""

from __future__ import annotations

import numpy as np
import pytest

from hetero.decode import SamplingParams
from hetero.decode.sampling import accept_or_resample, choose, make_generator, probabilities
from hetero.errors import ConfigError


@pytest.mark.parametrize("kwargs, word", [
    ({"max_new_tokens": -1}, "max_new_tokens"), ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"seed": "x"}, "seed"), ({"stop": ("",)}, "stop"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"),
])
def test_bad_params_name_the_argument(kwargs, word) -> None:
    with pytest.raises(ConfigError, match=word):
        SamplingParams(**kwargs)


def test_a_single_stop_string_becomes_a_tuple() -> None:
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)


def test_top_k_and_top_p_cut_the_distribution() -> None:
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1], np.float32))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [2 / 3, 1 / 3, 0.0, 0.0], rtol=1e-6)
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))  # 0.5 + 0.25 reaches 0.7
    np.testing.assert_allclose(p, [2 / 3, 1 / 3, 0.0, 0.0], rtol=1e-6)
    p = probabilities(logits, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(p, [0.5, 0.25, 0.15, 0.1], rtol=1e-6)


def test_speculative_acceptance_samples_exactly_the_target_distribution() -> None:
    """Whatever tokens are proposed, the emitted token is distributed as p (within Monte-Carlo error)."""
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    params = SamplingParams(temperature=1.0, seed=0)
    gen = make_generator(params)
    n = 20000
    for j, candidates in enumerate(([3], [1, 3], [0, 1, 2, 3], [])):
        counts = np.zeros(4)
        for i in range(n):
            tok, idx = accept_or_resample(logits, candidates, params, gen, j * n + i)
            assert idx is None or candidates[idx] == tok
            counts[tok] += 1
        # 4 standard deviations of a binomial proportion at n = 20000 is < 0.015
        np.testing.assert_allclose(counts / n, [0.4, 0.3, 0.2, 0.1], atol=0.015, rtol=0)


def test_greedy_acceptance_takes_the_argmax() -> None:
    logits = np.array([0.0, 3.0, 1.0, 3.0], np.float32)  # a tie: the first maximal logit, as torch.argmax
    assert accept_or_resample(logits, [2, 1], SamplingParams(), None) == (1, 1)
    assert accept_or_resample(logits, [2], SamplingParams(), None) == (1, None)
    assert choose(logits, SamplingParams(), None) == 1


def test_seeded_sampling_repeats_and_draws_only_tokens_with_mass() -> None:
    """A seed gives the same tokens every time (numpy's PCG64); top-k's cut tokens are never drawn."""
    logits = np.log(np.array([0.3, 0.05, 0.3, 0.05, 0.3], np.float32))
    params = SamplingParams(temperature=1.0, top_k=3, seed=7)
    draws = [[choose(logits, params, gen, i) for i in range(200)] for gen in (make_generator(params),
                                                                             make_generator(params))]
    assert draws[0] == draws[1] and set(draws[0]) == {0, 2, 4}
    assert make_generator(SamplingParams()) is None  # greedy needs none


def test_a_positions_token_does_not_depend_on_what_was_proposed_or_on_draw_order() -> None:
    """Seeded sampling emits at each position the token plain sampling emits there, whatever the draft proposed
    (a tree's candidates only say whether the draw is accepted), and asking positions out of order changes nothing."""
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    params = SamplingParams(temperature=1.0, seed=3)
    plain = [choose(logits, params, make_generator(params), i) for i in range(50)]
    backwards = make_generator(params)
    assert [choose(logits, params, backwards, i) for i in reversed(range(50))][::-1] == plain
    spec = make_generator(params)
    for i, want in enumerate(plain):
        for candidates in ([want], [(want + 1) % 4], [(want + 1) % 4, want], []):
            tok, idx = accept_or_resample(logits, candidates, params, spec, i)
            assert tok == want and (idx is None) == (want not in candidates)
