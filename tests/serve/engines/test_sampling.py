"""The torch engine's draw: inverse-CDF sampling over each row's own uniform."""

from __future__ import annotations

import random

import pytest
import torch

from rl360.serve.engines.sampling import draw, sample_rows
from rl360.types import SamplingParams


def test_draw_follows_the_distribution_and_never_picks_a_zero_probability_token() -> None:
    p = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0]])
    rng = random.Random(0)
    n = 40_000
    counts = [0] * 6
    for tok in draw(p.expand(n, 6).contiguous(), [rng.random() for _ in range(n)]):
        counts[tok] += 1
    assert counts[0] == counts[2] == counts[5] == 0
    for tok, want in ((1, 0.5), (3, 0.2), (4, 0.3)):  # 5 standard deviations at most
        sd = (want * (1 - want) / n) ** 0.5
        assert abs(counts[tok] / n - want) < 5 * sd, (tok, counts)


def test_draw_stays_on_the_last_real_token_when_the_cumsum_ends_below_one() -> None:
    p = torch.tensor([[0.25, 0.25, 0.4999, 0.0]])  # sums to 0.9999
    assert draw(p.expand(2, 4), [0.0, 0.9999999]) == [0, 2]


def test_non_finite_probabilities_are_refused() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        draw(torch.tensor([[0.5, float("nan")]]), [0.3])


def test_a_rows_tokens_depend_on_its_own_seed_only() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    sp = [SamplingParams(temperature=1.0, top_k=20) for _ in range(5)]
    alone = sample_rows(logits[2:3], sp[2:3], [random.Random(7)])
    batch = sample_rows(logits, sp, [random.Random(s) for s in (1, 2, 7, 3, 4)])
    assert batch[2] == alone[0]
