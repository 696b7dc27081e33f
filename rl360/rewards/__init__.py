"""Reward functions and grading utilities: tests passed, all pass, exact answer, format penalty,
weighted composition; a table (`REWARDS`, `build_reward`), a guard that grades a raising
reward function as a counted reward-function error, and the reward range a task declares
(`task_range`, `bound_reward`)."""

from rl360.rewards.base import (
    Guarded,
    RewardContext,
    RewardFn,
    guarded,
    reward_error_counts,
)
from rl360.rewards.bounds import (
    NonFiniteReward,
    RewardRange,
    bound_reward,
    parse_range,
    task_range,
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
    "NonFiniteReward",
    "RewardContext",
    "RewardFn",
    "RewardRange",
    "TestsPassed",
    "Weighted",
    "bound_reward",
    "build_reward",
    "env_reward",
    "guarded",
    "normalize_answer",
    "parse_range",
    "reward_error_counts",
    "task_range",
]
