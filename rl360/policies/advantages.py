"""Advantages over one group of rewards (the n attempts of one task).

Every estimator takes the group's rewards and an optional validity mask. A sample is invalid
when its episode failed because of the infrastructure (not the model): it gets advantage 0
and is left out of the group statistics entirely, so it cannot shift the baseline of the
valid samples (a failed sample scored as reward 0 and kept in the mean would).

Plain Python on lists of floats; nothing here imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol


class AdvantageFn(Protocol):
    def __call__(
        self, rewards: Sequence[float], valid: Sequence[bool] | None = None
    ) -> list[float]: ...


def _valid_rewards(
    rewards: Sequence[float], valid: Sequence[bool] | None
) -> tuple[list[float], list[bool]]:
    rs = [float(r) for r in rewards]
    ok = [True] * len(rs) if valid is None else [bool(v) for v in valid]
    if len(ok) != len(rs):
        raise ValueError(f"validity mask has {len(ok)} entries for {len(rs)} rewards")
    for i, (r, v) in enumerate(zip(rs, ok, strict=True)):
        if v and not math.isfinite(r):
            raise ValueError(f"reward {i} of the group is {r} (not finite) but marked valid")
    return rs, ok


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs)


def grpo_advantages(
    rewards: Sequence[float],
    valid: Sequence[bool] | None = None,
    *,
    eps: float = 1e-6,
    unbiased: bool = True,
) -> list[float]:
    """GRPO: (r - mean) / (std + eps) over the group's valid samples. A group with a single
    valid sample, or with equal rewards, gets advantage 0 everywhere."""
    rs, ok = _valid_rewards(rewards, valid)
    vals = [r for r, v in zip(rs, ok, strict=True) if v]
    if len(vals) < 2:
        return [0.0] * len(rs)
    mean = _mean(vals)
    ddof = 1 if unbiased else 0
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in vals) / (len(vals) - ddof))
    return [(r - mean) / (std + eps) if v else 0.0 for r, v in zip(rs, ok, strict=True)]


def drgrpo_advantages(rewards: Sequence[float], valid: Sequence[bool] | None = None) -> list[float]:
    """Dr.GRPO: r - mean over the valid samples; no std division (and no length
    normalisation: pair it with the seq-mean-token-sum-norm or token-mean reducer)."""
    rs, ok = _valid_rewards(rewards, valid)
    vals = [r for r, v in zip(rs, ok, strict=True) if v]
    if not vals:
        return [0.0] * len(rs)
    mean = _mean(vals)
    return [r - mean if v else 0.0 for r, v in zip(rs, ok, strict=True)]


def rloo_advantages(rewards: Sequence[float], valid: Sequence[bool] | None = None) -> list[float]:
    """RLOO: r_i minus the mean of the other valid samples' rewards (0 with < 2 valid)."""
    rs, ok = _valid_rewards(rewards, valid)
    vals = [r for r, v in zip(rs, ok, strict=True) if v]
    n = len(vals)
    if n < 2:
        return [0.0] * len(rs)
    total = math.fsum(vals)
    return [r - (total - r) / (n - 1) if v else 0.0 for r, v in zip(rs, ok, strict=True)]


def reinforce_advantages(
    rewards: Sequence[float], valid: Sequence[bool] | None = None, *, baseline: float = 0.0
) -> list[float]:
    """REINFORCE: r - a constant baseline (0 by default); invalid samples get 0."""
    rs, ok = _valid_rewards(rewards, valid)
    return [r - baseline if v else 0.0 for r, v in zip(rs, ok, strict=True)]


ADVANTAGES: dict[str, Callable[..., list[float]]] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "reinforce": reinforce_advantages,
}

_PARAMS: dict[str, frozenset[str]] = {
    "grpo": frozenset({"eps", "unbiased"}),
    "drgrpo": frozenset(),
    "rloo": frozenset(),
    "reinforce": frozenset({"baseline"}),
}


def build_advantage(name: str, **params: Any) -> AdvantageFn:
    """The estimator called `name` with its parameters bound, e.g.
    `build_advantage("grpo", eps=1e-4)(rewards, valid)`."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGES)}")
    unknown = set(params) - _PARAMS[name]
    if unknown:
        raise ValueError(
            f"advantage {name!r} takes no parameter(s) {sorted(unknown)}; "
            f"it takes {sorted(_PARAMS[name]) or 'none'}"
        )
    return partial(ADVANTAGES[name], **params)
