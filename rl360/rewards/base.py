"""Reward functions: what they see, how they are registered and built, and the guard that turns
a reward function that raises into a counted, visible reward-function error.

A reward function is a pure function of a `RewardContext` (the env has already run the tests,
extracted the answer, counted malformed tool calls) that returns an `rl360.types.Reward`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import msgspec

from rl360.types import Reward, Task

log = logging.getLogger(__name__)


class RewardContext(msgspec.Struct, omit_defaults=True):
    """Everything a grader may look at for one episode."""

    answer: str | None = None  # the final answer text (None: the episode gave none)
    reference: str | list[str] | None = None  # accepted answer(s)
    tests_passed: int = 0
    tests_total: int = 0
    malformed_tool_calls: int = 0
    has_final_answer: bool = True
    format_ok: bool = True  # the env could extract what it needed (e.g. a code block)
    task: Task | None = None
    info: dict[str, Any] = msgspec.field(default_factory=dict)


@runtime_checkable
class RewardFn(Protocol):
    name: str

    def __call__(self, ctx: RewardContext) -> Reward: ...


_errors: Counter[str] = Counter()
_errors_lock = threading.Lock()


def reward_error_counts() -> dict[str, int]:
    """How many times each reward function raised (or returned garbage) in this process."""
    with _errors_lock:
        return dict(_errors)


def _as_reward(out: object, name: str) -> Reward:
    if isinstance(out, Reward):
        reward = out
    elif isinstance(out, int | float) and not isinstance(out, bool):
        reward = Reward(value=float(out))
    else:
        raise TypeError(f"reward function {name!r} returned {type(out).__name__}, not a Reward")
    if not math.isfinite(reward.value):
        raise ValueError(f"reward function {name!r} returned a non-finite value {reward.value}")
    return reward


class Guarded:
    """Wraps a reward function: an exception (or a non-Reward, non-finite result) becomes a
    reward-function error: value `error_value`, component reward_error=1, the error text in info,
    and a per-function counter (reward_error_counts()). The caller never sees the exception."""

    def __init__(self, fn: RewardFn | Callable[[RewardContext], Reward], error_value: float = 0.0):
        self.fn = fn
        self.name = getattr(fn, "name", getattr(fn, "__name__", type(fn).__name__))
        self.error_value = error_value

    def __call__(self, ctx: RewardContext) -> Reward:
        try:
            return _as_reward(self.fn(ctx), self.name)
        except Exception as e:
            with _errors_lock:
                _errors[self.name] += 1
            log.warning("reward function %r failed: %s: %s", self.name, type(e).__name__, e)
            return Reward(
                value=self.error_value,
                components={"reward_error": 1.0},
                info={"reward_error": f"{self.name}: {type(e).__name__}: {e}"},
            )


def guarded(fn: RewardFn | Callable[[RewardContext], Reward]) -> Guarded:
    return fn if isinstance(fn, Guarded) else Guarded(fn)
