"""Reward functions and grading utilities: tests passed, all pass, exact answer, format penalty,
weighted composition; a table (`REWARDS`, `build_reward`) and a guard that grades a raising
reward function as a counted reward-function error."""

from rl360.rewards.base import (
    Guarded,
    RewardContext,
    RewardFn,
    guarded,
    reward_error_counts,
)
from rl360.rewards.graders import (
    REWARDS,
    AllPass,
    ExactAnswer,
    FormatPenalty,
    TestsPassed,
    Weighted,
    build_reward,
    env_reward,
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
    "env_reward",
    "guarded",
    "normalize_answer",
    "reward_error_counts",
]
