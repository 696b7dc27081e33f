"""Parking tasks that give no learning signal: the rollout controller's task filter.

A group whose scored episodes all got the same reward, and that reward is <= 0, teaches GRPO
nothing (every advantage is 0) and a task that does that group after group only costs
generation and grading; on the CPU demo the two Harbor tool tasks (multi-turn, a fresh sandbox
each, reward 0 at that model size) took ~35% of every step and set when a batch could be cut.
With `train.parking.after = k` a task whose last k settled groups were all like that is parked:
the next `train.parking.passes` times the task stream offers it, it is skipped; the time after
that it runs one group (a probe). A probe that is still all-failed parks it again; any group
with a reward above 0, or with variance, unparks it and clears its count. Groups that failed
entirely on the infrastructure say nothing about the task and change nothing. Only a task that
has given no signal in this run is parked: one that had a success or variance once and then
fails (a task the policy lost: docs/demo.md) keeps running every pass, since sampling is
its way back, and a task every episode solves is never parked (forgetting shows there first).

A skipped offer still takes its place in the stream (`tasks_taken`; the ledger records it as a
`park` event, so `run_ledger.account` does not count it as lost), and `state()` / `load()`
carry the parked set over a resume.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

from rl360.types import EpisodeRecord


def no_signal(records: Iterable[EpisodeRecord]) -> bool | None:
    """True: every scored episode got the same reward, <= 0. False: some signal. None: no
    episode was scored (all infrastructure failures)."""
    rewards = {r.reward.value for r in records if r.valid and r.reward is not None}
    if not rewards:
        return None
    return len(rewards) == 1 and max(rewards) <= 0.0


class TaskParking:
    def __init__(self, after: int, passes: int) -> None:
        """`after`: all-failed groups in a row that park a task (0: never); `passes`: how many
        offers of it the stream skips before a probe."""
        self.after, self.passes = after, passes
        self.streak: collections.Counter[str] = collections.Counter()
        self.parked: dict[str, int] = {}  # task id -> offers still to skip
        self.signalled: set[str] = set()  # tasks that gave signal once: never parked again

    def skip(self, task_id: str) -> bool:
        """The stream offers `task_id`: True to skip it (parked), False to run it."""
        left = self.parked.get(task_id)
        if left is None:
            return False
        if left > 0:
            self.parked[task_id] = left - 1
            return True
        del self.parked[task_id]  # a probe: its outcome parks it again or not
        return False

    def settled(self, task_id: str, records: Iterable[EpisodeRecord]) -> bool:
        """A group of `task_id` settled; True when this parks the task."""
        if self.after <= 0:
            return False
        none = no_signal(records)
        if none is None:
            return False
        if not none:
            self.streak.pop(task_id, None)
            self.parked.pop(task_id, None)
            self.signalled.add(task_id)
            return False
        if task_id in self.signalled:
            return False
        self.streak[task_id] += 1
        if self.streak[task_id] >= self.after and task_id not in self.parked:
            self.parked[task_id] = self.passes
            return True
        return False

    def state(self) -> dict[str, Any]:
        return {"streak": dict(self.streak), "parked": dict(self.parked),
                "signalled": sorted(self.signalled)}

    def load(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.streak = collections.Counter({str(k): int(v) for k, v in
                                           (state.get("streak") or {}).items()})
        self.parked = {str(k): int(v) for k, v in (state.get("parked") or {}).items()}
        self.signalled = {str(t) for t in state.get("signalled") or []}
