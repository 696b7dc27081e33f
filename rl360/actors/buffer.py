"""TrajectoryBuffer: completes groups, computes advantages, bounds staleness, cuts batches.

The rollout controller hands over a finished group as its episodes' small EpisodeRecords plus
the ObjectRefs of their trajectories (never the token data); the buffer computes the group's
advantages from the records with infra failures excluded from the statistics (those episodes
are dropped, not scored as 0), optionally drops groups whose rewards do not vary (no learning
signal), and queues the rest as refs. A cut batch is a RefBatch: refs, advantages and token
counts; each trainer rank fetches the trajectories of its own shard. `next_batch(version)` waits for
`groups_per_batch` groups and drops (or, with stale_policy="keep", keeps under the trainer's
truncated importance sampling) groups whose oldest generated token is more than
`max_staleness` versions behind the trainer.

With `train.oversampling = false` the controller starts exactly `groups_per_batch` groups per
batch and tells the buffer each group's batch index; batch b is cut once all its groups are
settled (queued, filtered or cancelled) and holds whatever survived (an empty one is skipped).
`train.curriculum.mode = "positive-first"` scales the non-positive advantages of a batch when
it is cut, by a factor ramping from `curriculum.floor` at step 1 to 1 at step `curriculum.steps`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rl360.actors.reward_stats import (
    episode_metrics,
    group_metrics,
    group_outcome,
    masked_metrics,
    timing_metrics,
    tito_metrics,
)
from rl360.policies.advantages import build_advantage
from rl360.recipe import CurriculumSection, TrainSection
from rl360.types import EpisodeRecord, TrainSample, Trajectory


@dataclass
class Member:
    """One trained episode of a group: its trajectory (an ObjectRef, or the Trajectory itself
    when it was handed over in process or restored from a checkpoint) and its small numbers."""

    ref: Any
    advantage: float
    reward: float
    tokens: int
    loss_tokens: int
    task_id: str = ""
    min_version: int = 0
    max_version: int = 0
    seqs: int = 1  # trained sequences: the primary sample and the session's other picked leaves
    group_id: str = ""  # its group (the run's ledger records which groups each step trained)


@dataclass
class GroupRecord:
    group_id: str
    task_id: str
    members: list[Member]
    rewards: list[float]  # valid episodes only
    min_version: int  # oldest version among the group's generated tokens
    statuses: dict[str, int]
    completed_at: float
    batch: int = -1  # the controller's batch index (train.oversampling = false), else -1
    records: list[EpisodeRecord] = field(default_factory=list)  # every episode, for the stats


@dataclass
class _StepStats:
    """The small records a step's metrics are computed from (`take_recent_stats`)."""

    records: list[EpisodeRecord] = field(default_factory=list)
    outcomes: list[dict[str, bool]] = field(default_factory=list)
    filtered_groups: int = 0
    filtered_episodes: int = 0

    def add(self, records: list[EpisodeRecord], filtered: int = 0) -> None:
        """One finished group: its records, its outcome, and its `filtered` (zero-variance)
        episodes when the buffer filtered it."""
        self.records.extend(records)
        self.outcomes.append(group_outcome(records))
        self.filtered_groups += bool(filtered)
        self.filtered_episodes += filtered

    def merge(self, other: _StepStats) -> None:
        self.records.extend(other.records)
        self.outcomes.extend(other.outcomes)
        self.filtered_groups += other.filtered_groups
        self.filtered_episodes += other.filtered_episodes


@dataclass
class RefBatch:
    """A global batch as the driver holds it: refs and advantages, no token data.
    `policy_version` is the trainer's version when the batch was cut."""

    members: list[Member]
    step: int = 0
    policy_version: int = 0

    @property
    def loss_tokens(self) -> int:
        return sum(m.loss_tokens for m in self.members)

    @property
    def seqs(self) -> int:
        return sum(m.seqs for m in self.members if m.loss_tokens > 0)


def to_samples(trajs: list[Trajectory], advantages: list[float]) -> list[TrainSample]:
    """One TrainSample per picked leaf: the trajectory's own (primary) sample and each of its
    `branches` (a session's other picked leaves), all with the episode's advantage."""
    out = []
    for t, a in zip(trajs, advantages, strict=True):
        if t.status == "infra_error" or t.reward is None or not t.tokens:
            continue
        for s in (t, *t.branches):
            out.append(TrainSample(
                tokens=list(s.tokens),
                mask=list(s.mask),
                sampling_logprobs=[lp if lp is not None else 0.0 for lp in s.logprobs],
                advantage=float(a),
                versions=[v if v is not None else -1 for v in s.versions],
                reward=float(t.reward.value),
                group_id=t.group_id or "",
                task_id=t.task_id or "",
            ))
    return out


class _StoredGroup(msgspec.Struct):
    """A queued group in a checkpoint (its trajectories fetched and stored whole)."""

    group_id: str
    task_id: str
    trajectories: list[Trajectory]
    advantages: list[float]
    rewards: list[float]
    min_version: int
    statuses: dict[str, int]
    completed_at: float
    batch: int = -1


def curriculum_factor(cfg: CurriculumSection, step: int) -> float:
    """The positive-first curriculum's scale of non-positive advantages at `step` (1-based):
    `floor` at step 1, linear to 1 at `steps`; 1 without a curriculum."""
    if cfg.mode == "none" or step >= cfg.steps:
        return 1.0
    ramp = max(0, step - 1) / max(1, cfg.steps - 1)
    return cfg.floor + (1.0 - cfg.floor) * ramp


class TrajectoryBuffer:
    def __init__(self, config: TrainSection, advantage: str) -> None:
        """`config`: the recipe's [train] section (group size, batch, staleness, filters);
        `advantage`: the estimator's name (trainer.advantage)."""
        self.cfg = config
        self.advantage = build_advantage(advantage)
        self.groups: collections.deque[GroupRecord] = collections.deque()
        self.counts: collections.Counter[str] = collections.Counter()
        self._stale_unclaimed = 0  # dropped as stale, not yet reported to the controller
        self._changed = asyncio.Event()
        # a step's metrics describe the batch it trained: the groups of the batches cut since
        # the previous `take_recent_stats`, plus the groups that finished without being queued
        # (filtered for zero variance, all infra failures, dropped as stale) before that cut.
        # Counting every episode finished since the previous step instead made an async run's
        # first step report its whole head start (512 episodes) and the second none.
        self._unbatched = _StepStats()  # finished, not queued, since the last cut
        self._cut_stats = _StepStats()  # cut since the last take_recent_stats
        self._finished = 0  # episodes finished since the last take (the generation stream)
        self._recent_tokens = 0  # their loss tokens
        # train.oversampling = false: the next batch index to cut and how many groups of each
        # open batch are settled (queued, filtered or cancelled)
        self._next_b = 0
        self._settled: collections.Counter[int] = collections.Counter()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def size(self) -> int:
        return len(self.groups)

    async def take_dropped_stale(self) -> int:
        """The groups dropped as stale since the last call. The controller gives their batch
        slots to new groups (as it does for filtered ones); else its staleness gate would count
        them as trained and hold every later group back by their number."""
        n, self._stale_unclaimed = self._stale_unclaimed, 0
        return n

    async def add_group(self, group_id: str, task_id: str, records: list[EpisodeRecord],
                        wrapped: list[list[Any]], batch: int = -1) -> bool:
        """Take a finished group: its episodes' records and their trajectory refs (inside a
        list, so Ray passes them unresolved: the buffer never fetches token data). Returns
        whether it was queued for training (False: filtered out). `batch` >= 0: the group's
        batch index (train.oversampling = false), settled whether queued or filtered."""
        queued = self._add(group_id, task_id, records, list(wrapped[0]), batch)
        if batch >= 0:
            self.settle_group(batch)
        return queued

    def settle_group(self, batch: int) -> None:
        """One group of `batch` is done (train.oversampling = false): queued, filtered, or
        cancelled and not replaced."""
        if batch >= self._next_b:
            self._settled[batch] += 1
        self._notify()

    async def skip_group(self, batch: int) -> None:
        """A group of `batch` was cancelled and will not be replaced (oversampling = false)."""
        self.settle_group(batch)

    async def close_open_batches(self) -> int:
        """Resume (oversampling = false): the groups in flight at the checkpoint are gone (their
        tasks run again in new batches), so every batch this buffer has seen a group of is cut
        with what settled. Returns the first batch index not used yet."""
        seen = [b for b, n in self._settled.items() if n] + [g.batch for g in self.groups]
        end = max(max(seen, default=-1) + 1, self._next_b)
        for b in range(self._next_b, end):
            self._settled[b] = self.cfg.groups_per_batch
        self._notify()
        return end

    def add_trajectories(self, group_id: str, task_id: str, trajs: list[Trajectory]) -> bool:
        """The same for trajectories at hand (in process, tests)."""
        return self._add(group_id, task_id, [t.record() for t in trajs], list(trajs))

    def _add(self, group_id: str, task_id: str, records: list[EpisodeRecord],
             refs: list[Any], batch: int = -1) -> bool:
        valid = [r.valid for r in records]
        self._finished += len(records)
        for r in records:
            self.counts[f"episodes_{r.status}"] += 1
            if r.valid and r.reward is not None:
                self._recent_tokens += r.loss_tokens
        rewards = [r.reward.value if ok and r.reward else 0.0
                   for r, ok in zip(records, valid, strict=True)]
        good = [r for r, ok in zip(rewards, valid, strict=True) if ok]
        if not good:
            self.counts["groups_all_infra_error"] += 1
            self._unbatched.add(records)
            return False
        if self.cfg.filter_zero_variance and max(good) - min(good) < 1e-9:
            self.counts["groups_zero_variance"] += 1
            self._unbatched.add(records, filtered=len(good))
            return False
        adv = self.advantage(rewards, valid)
        members = [Member(ref=ref, advantage=float(a), reward=r.reward.value, tokens=r.tokens,
                          loss_tokens=r.loss_tokens, task_id=r.task_id,
                          min_version=r.min_version, max_version=r.max_version, seqs=r.samples,
                          group_id=group_id)
                   for r, ref, a, ok in zip(records, refs, adv, valid, strict=True)
                   if ok and r.reward is not None and r.tokens > 0]
        trained = [r for r, ok in zip(records, valid, strict=True) if ok and r.tokens > 0]
        self.groups.append(GroupRecord(
            group_id=group_id, task_id=task_id, members=members, rewards=good,
            min_version=min((r.min_version for r in trained if r.loss_tokens), default=0),
            statuses=dict(collections.Counter(r.status for r in records)),
            completed_at=time.time(), batch=batch, records=list(records),
        ))
        self.counts["groups_queued"] += 1
        self._notify()
        return True

    async def next_batch(self, trainer_version: int, step: int,
                         timeout_s: float = 3600.0) -> RefBatch | None:
        """Wait for a full batch usable at `trainer_version`; None on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._drop_stale(trainer_version)
            if not self.cfg.oversampling:
                cut = self._cut_settled(trainer_version, step)
                if cut is not None:
                    return cut
            elif len(self.groups) >= self.cfg.groups_per_batch:
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
        kept: collections.deque[GroupRecord] = collections.deque()
        for g in self.groups:
            if version - g.min_version <= self.cfg.max_staleness:
                kept.append(g)
            else:  # not trained: its episodes count in the next cut's stats
                self._unbatched.add(g.records)
        self.counts["groups_dropped_stale"] += len(self.groups) - len(kept)
        self._stale_unclaimed += len(self.groups) - len(kept)
        self.groups = kept

    def _cut(self, version: int, step: int) -> RefBatch:
        """The `groups_per_batch` queued groups sampled by the oldest policies (ties: in the
        order they completed): a group near the staleness bound is trained before it would
        be dropped, and a slow group does not lose its place to quicker, newer ones."""
        order = sorted(range(len(self.groups)), key=lambda i: self.groups[i].min_version)
        take = set(order[: self.cfg.groups_per_batch])
        groups = [g for i, g in enumerate(self.groups) if i in take]
        self.groups = collections.deque(g for i, g in enumerate(self.groups) if i not in take)
        return self._batch(groups, version, step)

    def _cut_settled(self, version: int, step: int) -> RefBatch | None:
        """The oldest batch whose groups are all settled, with the groups that survived;
        batches where none survived are skipped (counted). None: no batch is complete."""
        while self._settled[self._next_b] >= self.cfg.groups_per_batch:
            b = self._next_b
            del self._settled[b]
            self._next_b += 1
            groups = [g for g in self.groups if g.batch <= b]
            self.counts["groups_not_replaced"] += max(0, self.cfg.groups_per_batch - len(groups))
            if not groups:
                self.counts["batches_empty"] += 1
                continue
            self.groups = collections.deque(g for g in self.groups if g.batch > b)
            return self._batch(groups, version, step)
        return None

    def _batch(self, groups: list[GroupRecord], version: int, step: int) -> RefBatch:
        for g in groups:
            self._cut_stats.add(g.records)
        self._cut_stats.merge(self._unbatched)  # the groups that finished unqueued before it
        self._unbatched = _StepStats()
        members = [m for g in groups for m in g.members]
        factor = curriculum_factor(self.cfg.curriculum, step)
        if factor != 1.0:  # positive-first: non-positive advantages count less early on
            members = [m if m.advantage > 0 else dataclasses.replace(m, advantage=m.advantage * factor)
                       for m in members]
        return RefBatch(members=members, step=step, policy_version=version)

    async def take_recent_stats(self) -> dict[str, Any]:
        """The metrics of the batches cut since the previous call (`episode_metrics` over their
        groups and the groups that finished unqueued before the cut), the generation stream
        since then (`episodes_finished`, `generated_tokens`), and the counters."""
        st, self._cut_stats = self._cut_stats, _StepStats()
        em = episode_metrics(st.records)
        scored = [r for r in st.records if r.valid and r.reward is not None]
        out = {
            "episodes": len(scored),  # scored episodes (infrastructure failures: infra_rate)
            "reward_mean": em["reward_mean"],
            "pass_rate": em["pass_rate"],
            "episodes_finished": self._finished,
            "generated_tokens": self._recent_tokens,
            "queued_groups": len(self.groups),
            **{f"count/{k}": v for k, v in self.counts.items()},
        }
        # per domain / task / component, group outcomes, masked episodes (reward_stats.py)
        out.update({k: v for k, v in em.items() if "/" in k or k in ("infra_rate", "tokens")})
        out.update(group_metrics(st.outcomes, st.filtered_groups))
        out.update(masked_metrics(st.records, st.filtered_episodes))
        out.update(timing_metrics(st.records))
        out.update(tito_metrics(st.records))
        self._finished, self._recent_tokens = 0, 0
        return out

    async def state(self) -> bytes:
        """The queued groups with their trajectories (fetched now: a checkpoint must hold the
        data, not refs that die with the run) and the counters."""
        stored = []
        for g in list(self.groups):
            trajs = [m.ref if isinstance(m.ref, Trajectory) else await m.ref for m in g.members]
            stored.append(_StoredGroup(
                group_id=g.group_id, task_id=g.task_id, trajectories=trajs,
                advantages=[m.advantage for m in g.members], rewards=g.rewards,
                min_version=g.min_version, statuses=g.statuses, completed_at=g.completed_at,
                batch=g.batch))
        return msgspec.msgpack.encode({"groups": stored, "counts": dict(self.counts),
                                       "next_batch": self._next_b,
                                       "settled": {str(k): v for k, v in self._settled.items()}})

    async def load_state(self, blob: bytes) -> None:
        data = msgspec.msgpack.decode(blob, type=dict[str, Any])
        self.groups = collections.deque()
        for raw in data["groups"]:
            g = msgspec.convert(raw, _StoredGroup)
            members = []
            for t, a in zip(g.trajectories, g.advantages, strict=True):
                r = t.record()
                members.append(Member(ref=t, advantage=a, reward=r.reward.value if r.reward else 0.0,
                                      tokens=r.tokens, loss_tokens=r.loss_tokens,
                                      task_id=r.task_id, min_version=r.min_version,
                                      max_version=r.max_version, seqs=r.samples,
                                      group_id=g.group_id))
            self.groups.append(GroupRecord(
                group_id=g.group_id, task_id=g.task_id, members=members, rewards=g.rewards,
                min_version=g.min_version, statuses=g.statuses, completed_at=g.completed_at,
                batch=g.batch, records=[t.record() for t in g.trajectories]))
        self.counts = collections.Counter(data["counts"])
        self._next_b = int(data.get("next_batch", 0))
        self._settled = collections.Counter({int(k): v for k, v in data.get("settled", {}).items()})
        self._notify()
