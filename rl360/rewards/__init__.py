"""Reward functions and grading utilities: tests passed, all pass, exact answer, format penalty,
weighted composition; a registry (`REWARDS`, `build_reward`) and a guard that grades a raising
reward function as a counted reward-function error."""

from rl360.rewards.base import (
    REWARDS,
    Guarded,
    RewardContext,
    RewardFn,
    build_reward,
    guarded,
    register_reward,
    reward_error_counts,
)
from rl360.rewards.graders import (
    AllPass,
    ExactAnswer,
    FormatPenalty,
    TestsPassed,
    Weighted,
    normalize_answer,
)

__all__ = [
    "REWARDS",
    "AllPass",
    "ExactAnswer",
    "FormatPenalty",
    "Guarded",
    "RewardContext",
    "RewardFn",
    "TestsPassed",
    "Weighted",
    "build_reward",
    "guarded",
    "normalize_answer",
    "register_reward",
    "reward_error_counts",
]
