"""The reward range a task declares, and bounding a reward to it.

A task declares the range its reward lies in as `reward_range = [low, high]`: a code task's
JSONL record field, a full task record's `data.reward_range`, a Harbor task's `[verifier]
reward_range` in task.toml. The default is [0, 1]. A reward outside the range is clamped to it
and counted (component `reward_clamped` = 1, and the episode's `reward_clamped` counter); a
non-finite reward is no reward at all: `NonFiniteReward`, scored as an error with reward 0.
So a verifier that writes 1e9 cannot swamp its group's normalisation.

A recipe's format penalty subtracts from the task's reward: an env that applies one widens the
low end by the penalty (`RewardRange.widened`), so the penalty still counts on a reward at the
low end.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from rl360.types import Reward, Task

DEFAULT_RANGE = (0.0, 1.0)


class NonFiniteReward(ValueError):
    """A grader produced NaN or an infinity: there is no reward to train on."""


class RewardRange(msgspec.Struct, frozen=True):
    low: float = DEFAULT_RANGE[0]
    high: float = DEFAULT_RANGE[1]

    def widened(self, below: float) -> RewardRange:
        """This range with its low end `below` lower (a penalty the env subtracts)."""
        return RewardRange(self.low - abs(below), self.high)


def parse_range(value: Any, where: str) -> RewardRange:
    """A RewardRange from [low, high] (two finite numbers, low < high); ValueError naming
    `where` otherwise."""
    if value is None:
        return RewardRange()
    ok = (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    )
    if not ok or not all(math.isfinite(v) for v in value) or not value[0] < value[1]:
        raise ValueError(
            f"{where}: reward_range must be [low, high], two finite numbers with low < high, "
            f"got {value!r}"
        )
    return RewardRange(float(value[0]), float(value[1]))


def task_range(task: Task) -> RewardRange:
    """The range `task` declares (`data["reward_range"]`), default [0, 1]."""
    return parse_range(task.data.get("reward_range"), f"task {task.id!r}")


def bound_reward(reward: Reward, rng: RewardRange) -> tuple[Reward, bool]:
    """(reward with its value clamped to `rng`, whether it was clamped); the original value
    goes to info["unclamped_reward"]. Raises NonFiniteReward for NaN or an infinity."""
    v = reward.value
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise NonFiniteReward(f"the reward {v!r} is not a finite number")
    if rng.low <= v <= rng.high:
        return reward, False
    clamped = min(max(float(v), rng.low), rng.high)
    out = Reward(value=clamped, components={**reward.components, "reward_clamped": 1.0},
                 info={**reward.info, "unclamped_reward": float(v)})
    return out, True
