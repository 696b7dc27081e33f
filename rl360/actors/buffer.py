"""TrajectoryBuffer: completes groups, computes advantages, bounds staleness, cuts batches.

The rollout controller hands over a finished group as ObjectRefs (never the data); the buffer
reads the trajectories, computes the group's advantages with infra failures excluded from the
statistics (their samples are dropped, not scored as 0), optionally drops groups whose rewards
do not vary (no learning signal), and queues the rest. `next_batch(version)` waits for
`groups_per_batch` groups and drops (or, with stale_policy="keep", keeps under the trainer's
truncated importance sampling) groups whose oldest generated token is more than
`max_staleness` versions behind the trainer.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import msgspec

from rl360.policies.advantages import build_advantage
from rl360.recipe import TrainSection
from rl360.types import Batch, TrainSample, Trajectory


class GroupRecord(msgspec.Struct):
    group_id: str
    task_id: str
    samples: list[TrainSample]
    rewards: list[float]  # valid episodes only
    min_version: int  # oldest version among the group's generated tokens
    statuses: dict[str, int]
    completed_at: float


def to_samples(trajs: list[Trajectory], advantages: list[float]) -> list[TrainSample]:
    out = []
    for t, a in zip(trajs, advantages, strict=True):
        if t.status == "infra_error" or t.reward is None or not t.tokens:
            continue
        out.append(TrainSample(
            tokens=list(t.tokens),
            mask=list(t.mask),
            sampling_logprobs=[lp if lp is not None else 0.0 for lp in t.logprobs],
            advantage=float(a),
            versions=[v if v is not None else -1 for v in t.versions],
            reward=float(t.reward.value),
            group_id=t.group_id or "",
            task_id=t.task_id or "",
        ))
    return out


class TrajectoryBuffer:
    def __init__(self, config: TrainSection, advantage: str) -> None:
        """`config`: the recipe's [train] section (group size, batch, staleness, filters);
        `advantage`: the estimator's name (trainer.advantage)."""
        self.cfg = config
        self.advantage = build_advantage(advantage)
        self.groups: collections.deque[GroupRecord] = collections.deque()
        self.counts: collections.Counter[str] = collections.Counter()
        self._changed = asyncio.Event()
        # every valid episode since the last batch was cut (the reward curve uses all of them,
        # also the groups filtered for zero variance)
        self._recent_rewards: list[float] = []
        self._recent_pass: list[float] = []
        self._recent_tokens = 0

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def size(self) -> int:
        return len(self.groups)

    async def add_group(self, group_id: str, task_id: str, wrapped: list[list[Any]]) -> bool:
        """Take a finished group (its trajectory refs inside a list, so Ray passes them
        unresolved). Returns whether it was queued for training (False: filtered out)."""
        trajs: list[Trajectory] = list(await asyncio.gather(*wrapped[0]))
        return self.add_trajectories(group_id, task_id, trajs)

    def add_trajectories(self, group_id: str, task_id: str, trajs: list[Trajectory]) -> bool:
        valid = [t.status != "infra_error" and t.reward is not None for t in trajs]
        for t in trajs:
            self.counts[f"episodes_{t.status}"] += 1
        rewards = [t.reward.value if ok and t.reward else 0.0 for t, ok in zip(trajs, valid, strict=True)]
        for t, ok in zip(trajs, valid, strict=True):
            if ok and t.reward is not None:
                self._recent_rewards.append(t.reward.value)
                self._recent_pass.append(float(t.reward.components.get("all_pass", t.reward.value >= 1.0)))
                self._recent_tokens += sum(t.mask)
        good = [r for r, ok in zip(rewards, valid, strict=True) if ok]
        if not good:
            self.counts["groups_all_infra_error"] += 1
            return False
        if self.cfg.filter_zero_variance and max(good) - min(good) < 1e-9:
            self.counts["groups_zero_variance"] += 1
            return False
        adv = self.advantage(rewards, valid)
        samples = to_samples(trajs, adv)
        gen_versions = [v for s in samples for v, m in zip(s.versions, s.mask, strict=True) if m]
        self.groups.append(GroupRecord(
            group_id=group_id, task_id=task_id, samples=samples, rewards=good,
            min_version=min(gen_versions) if gen_versions else 0,
            statuses=dict(collections.Counter(t.status for t in trajs)),
            completed_at=time.time(),
        ))
        self.counts["groups_queued"] += 1
        self._notify()
        return True

    async def next_batch(self, trainer_version: int, step: int, timeout_s: float = 3600.0) -> Batch | None:
        """Wait for a full batch usable at `trainer_version`; None on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._drop_stale(trainer_version)
            if len(self.groups) >= self.cfg.groups_per_batch:
                return self._cut(trainer_version, step)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return None

    def _drop_stale(self, version: int) -> None:
        if self.cfg.stale_policy == "keep":
            return
        kept = collections.deque(g for g in self.groups if version - g.min_version <= self.cfg.max_staleness)
        self.counts["groups_dropped_stale"] += len(self.groups) - len(kept)
        self.groups = kept

    def _cut(self, version: int, step: int) -> Batch:
        groups = [self.groups.popleft() for _ in range(self.cfg.groups_per_batch)]
        samples = [s for g in groups for s in g.samples]
        return Batch(samples=samples, step=step, policy_version=version)

    async def take_recent_stats(self) -> dict[str, Any]:
        """Reward / pass stats of every valid episode since the previous call, and counters."""
        r, p = self._recent_rewards, self._recent_pass
        out = {
            "episodes": len(r),
            "reward_mean": sum(r) / len(r) if r else float("nan"),
            "pass_rate": sum(p) / len(p) if p else float("nan"),
            "generated_tokens": self._recent_tokens,
            "queued_groups": len(self.groups),
            **{f"count/{k}": v for k, v in self.counts.items()},
        }
        self._recent_rewards, self._recent_pass, self._recent_tokens = [], [], 0
        return out

    async def state(self) -> bytes:
        return msgspec.msgpack.encode({"groups": list(self.groups), "counts": dict(self.counts)})

    async def load_state(self, blob: bytes) -> None:
        data = msgspec.msgpack.decode(blob, type=dict[str, Any])
        self.groups = collections.deque(msgspec.convert(g, GroupRecord) for g in data["groups"])
        self.counts = collections.Counter(data["counts"])
        self._notify()
