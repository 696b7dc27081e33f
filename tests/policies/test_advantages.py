"""Group advantages: values, and infra failures excluded from the group statistics."""

from __future__ import annotations

import math
import statistics

import pytest

from rl360.policies.advantages import ADVANTAGES, build_advantage

REWARDS = [1.0, 0.0, 1.0, 0.5, 0.0]


def test_grpo_is_mean_over_unbiased_std() -> None:
    adv = build_advantage("grpo", eps=0.0)(REWARDS)
    mean, std = statistics.mean(REWARDS), statistics.stdev(REWARDS)
    assert adv == pytest.approx([(r - mean) / std for r in REWARDS])


def test_drgrpo_subtracts_the_mean_only() -> None:
    adv = build_advantage("drgrpo")(REWARDS)
    assert adv == pytest.approx([r - 0.5 for r in REWARDS])


def test_rloo_uses_the_leave_one_out_mean() -> None:
    adv = build_advantage("rloo")(REWARDS)
    n = len(REWARDS)
    expected = [r - (sum(REWARDS) - r) / (n - 1) for r in REWARDS]
    assert adv == pytest.approx(expected)
    assert sum(adv) == pytest.approx(0.0)


def test_reinforce_subtracts_a_constant_baseline() -> None:
    assert build_advantage("reinforce")(REWARDS) == REWARDS
    assert build_advantage("reinforce", baseline=0.25)(REWARDS) == pytest.approx(
        [r - 0.25 for r in REWARDS]
    )


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_infra_failures_are_excluded_from_group_statistics(name: str) -> None:
    fn = build_advantage(name)
    valid = [True, True, False, True, True]
    # the failed sample's stored reward, whatever it is (0, NaN), must not move the others
    with_zero = fn([1.0, 0.0, 0.0, 0.5, 1.0], valid)
    with_nan = fn([1.0, 0.0, math.nan, 0.5, 1.0], valid)
    alone = fn([1.0, 0.0, 0.5, 1.0])
    assert with_zero[2] == 0.0 and with_nan[2] == 0.0
    for got in (with_zero, with_nan):
        assert [a for i, a in enumerate(got) if i != 2] == pytest.approx(alone)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
def test_degenerate_groups_get_zero_advantage(name: str) -> None:
    fn = build_advantage(name)
    assert fn([0.7, 0.7, 0.7]) == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)
    assert fn([1.0, 0.0], [False, False]) == [0.0, 0.0]
    assert fn([1.0, 0.0], [True, False]) == [0.0, 0.0]


def test_bad_input_fails_clearly() -> None:
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        build_advantage("ppo")
    with pytest.raises(ValueError, match="takes no parameter"):
        build_advantage("rloo", eps=1e-3)
    with pytest.raises(ValueError, match="2 entries for 3 rewards"):
        build_advantage("grpo")([1.0, 0.0, 1.0], [True, True])
    with pytest.raises(ValueError, match="not finite"):
        build_advantage("drgrpo")([1.0, math.inf])
