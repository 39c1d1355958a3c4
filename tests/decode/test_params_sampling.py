"""SamplingParams validation, the sampling distribution, and the speculative acceptance rule's exactness."""

from __future__ import annotations

import pytest
import torch

from hetero.decode import SamplingParams
from hetero.decode.sampling import accept_or_resample, probabilities
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
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))  # 0.5 + 0.25 reaches 0.7
    torch.testing.assert_close(p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    p = probabilities(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.25, 0.15, 0.1]))


def test_speculative_acceptance_samples_exactly_the_target_distribution() -> None:
    """Whatever tokens are proposed, the emitted token is distributed as p (within Monte-Carlo error)."""
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    params = SamplingParams(temperature=1.0, seed=0)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    for candidates in ([3], [1, 3], [0, 1, 2, 3], []):
        counts = torch.zeros(4)
        for _ in range(n):
            tok, idx = accept_or_resample(logits, candidates, params, gen)
            assert idx is None or candidates[idx] == tok
            counts[tok] += 1
        # 4 standard deviations of a binomial proportion at n = 20000 is < 0.015
        torch.testing.assert_close(counts / n, torch.tensor([0.4, 0.3, 0.2, 0.1]), atol=0.015, rtol=0)


def test_greedy_acceptance_takes_the_argmax() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert accept_or_resample(logits, [2, 1], SamplingParams(), None) == (1, 1)
    assert accept_or_resample(logits, [2], SamplingParams(), None) == (1, None)
