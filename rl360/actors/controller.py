"""RolloutController: keeps episodes in flight and forwards their refs to the buffer.

A group is the `group_size` attempts of one task. The controller starts groups on the env
actors until `max_in_flight_groups` run, the buffer holds `capacity_groups` (back-pressure),
or the staleness gate closes: the groups of batch b (the b-th `groups_per_batch` groups) may
start only once the engines serve version >= b - max_staleness. With max_staleness = 0 that
is synchronous on-policy RL; with >= 1 generation overlaps training, and staleness stays
bounded by construction (the buffer still measures and enforces it per token).

Tasks stream from the task files, epoch after epoch. Tail cancellation: once all but
`train.tail.keep` groups of the oldest open batch are done, a group that has run longer than
`tail.factor` x the batch's median group time is cancelled and its task re-queued at the back;
ray.cancel reaches the episode's asyncio task in the env actor, which cancels its engine call and
closes its session (actors/env_pool.py).

Recipe knobs: `train.rolling_start` (size, interval_s) opens the first max_in_flight_groups
groups in waves; `train.oversampling = false` never replaces a filtered or cancelled group (the
batch is whatever survived, see actors/buffer.py) instead of giving its slot to another group;
`train.parking` (after, passes) skips tasks that keep giving no signal (actors/parking.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray

from rl360.actors.breaker import CircuitBreaker
from rl360.actors.env_pool import cancel_episodes
from rl360.actors.parking import TaskParking
from rl360.actors.reward_stats import task_domain
from rl360.actors.task_stream import task_stream
from rl360.recipe import TrainSection
from rl360.types import EpisodeRecord, Task

LOST_COOLDOWN_S = 30.0

log = logging.getLogger("rl360.controller")


class ControllerFailed(RuntimeError):
    """The rollout controller stopped (its circuit breaker tripped, or a task of it broke);
    the message says why in one line."""


@dataclass
class _Group:
    task: Task
    # per episode, what the controller fetches: the group's ObjectRef[list[EpisodeRecord]]
    # (the same ref for every member) until a member is re-run, then its own ObjectRef
    records: list[Any]
    refs: list[Any]  # ObjectRef[Trajectory] per episode: handed on, never fetched here
    batch: int
    started: float = field(default_factory=time.monotonic)
    actors: list[int] = field(default_factory=list)  # which env actor runs each episode
    reruns: list[int] = field(default_factory=list)
    occ: int = -1  # the task's position in the stream (kept when it is re-queued or resumed)

    def __post_init__(self) -> None:
        self.reruns = [0] * len(self.records)


class RolloutController:
    def __init__(self, config: TrainSection, engine_replicas: int, env_actors: list[Any],
                 buffer: Any, publisher: Any, seed: int = 0) -> None:
        """`config`: the recipe's [train] section (tasks, group size, batch, staleness,
        in-flight and tail limits, sampling); `engine_replicas` sizes the admission ramp."""
        self.cfg = config
        self.engine_replicas = engine_replicas
        self.sampling = msgspec.to_builtins(config.sampling)
        self.env_actors = env_actors
        self.buffer = buffer
        self.publisher = publisher
        self.tasks = task_stream(self.cfg.tasks, self.cfg.task_limit, self.cfg.shuffle_window, seed)
        # (task, first batch index it may run in, its stream position)
        self.requeued: collections.deque[tuple[Task, int, int]] = collections.deque()
        self.inflight: dict[str, _Group] = {}
        self.started = 0  # groups that count towards batches (sets each group's batch index)
        self.seq = 0  # every group ever started (names)
        self.tasks_taken = 0
        self.parking = TaskParking(config.parking.after, config.parking.passes)
        self.served_version = 0
        # the buffer's queue length as last read plus the groups queued since: an upper bound
        # (only the trainer's takes and stale drops shrink it), so admission asks the buffer
        # only when that bound says the buffer may be near full, not once per group
        self._queued_bound = 0
        self._handing = 0  # a group between `inflight` and the buffer (hand-overs take a lock)
        self.done_times: dict[int, list[float]] = collections.defaultdict(list)
        self.counts: collections.Counter[str] = collections.Counter()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._tail_task: asyncio.Task[None] | None = None
        self._watchers: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None
        self._lost_at: dict[int, float] = {}  # env actor index -> when it last lost an episode
        self._handoff = asyncio.Lock()
        # task id -> the env actor its groups run on (task affinity: the actor's verify cache
        # then holds that task's earlier answers, so an answer seen in an earlier step is not
        # graded again); assigned round robin at first sight, bounded
        self._home: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.breaker = CircuitBreaker(config.breaker)
        self._rr = 0
        self._t0 = time.monotonic()  # rolling start: when the controller started, and its seq
        self._seq0 = 0
        # the run's ledger (what started, settled, re-ran, was re-queued), drained by the driver
        # into <run dir>/ledger.jsonl: rl360.actors.run_ledger counts lost and duplicated tasks
        self._events: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ control

    async def start(self, groups_started: int = 0, tasks_taken: int = 0,
                    pending: list[Task] | None = None,
                    pending_occ: list[int] | None = None, seq: int = 0,
                    parking: dict[str, Any] | None = None) -> None:
        """Start the rollout loop; a resume passes a checkpoint's `checkpoint_state`: the
        groups settled, the stream position and the tasks to run first (in flight or
        re-queued when it was taken) with their stream positions, and the parked tasks."""
        self.parking.load(parking)
        self.started = groups_started
        self.seq = max(seq, groups_started)  # group ids stay unique over a resume
        for _ in range(tasks_taken):  # resume: skip what earlier runs already took
            next(self.tasks)
        self.tasks_taken = tasks_taken
        pending = pending or []
        occs = list(pending_occ or [])
        occs += [-1] * (len(pending) - len(occs))  # a checkpoint from before occ was recorded
        self.requeued.extend((t, 0, o) for t, o in zip(pending, occs, strict=True))
        if not self.cfg.oversampling:
            # resume: batches that had groups in flight at the checkpoint are cut with what
            # settled (their tasks run again first, in new batches)
            batch = await self.buffer.close_open_batches.remote()
            self.started = batch * self.cfg.groups_per_batch
            self.seq = max(self.seq, self.started)
        self._t0, self._seq0 = time.monotonic(), self.seq
        self._queued_bound = await self.buffer.size.remote()  # a resume's loaded groups
        loop = asyncio.get_running_loop()
        self._loop_task = loop.create_task(self._run(), name="rl360-rollout-loop")
        self._loop_task.add_done_callback(self._on_done)
        if self.cfg.tail.keep > 0:
            self._tail_task = loop.create_task(self._tail_loop(), name="rl360-tail-cancel")
            self._tail_task.add_done_callback(self._on_done)

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()
            log.error("controller task %s failed: %r", task.get_name(), self._failure)

    async def stop(self) -> dict[str, Any]:
        for t in (self._loop_task, self._tail_task):
            if t is not None:
                t.cancel()
        for g in self.inflight.values():
            cancel_episodes(g.records)
        return self._status()

    async def status(self) -> dict[str, Any]:
        """Progress and counters; raises ControllerFailed once the controller has stopped."""
        if self._failure is not None:
            raise ControllerFailed(str(self._failure) if isinstance(self._failure, RuntimeError)
                                   else f"rollout controller failed: {self._failure!r}")
        return self._status()

    async def checkpoint_state(self) -> tuple[bytes, dict[str, Any]]:
        """The buffer's state and what a resume needs, taken together while no group is handed
        over (so no group is both queued and pending, or neither): the groups settled, the
        task stream's position, and every task started but not settled (in flight, re-queued),
        which a resume runs first. Nothing is skipped; only in-flight work is redone."""
        async with self._handoff:
            blob = await self.buffer.state.remote()
            pending = [g.task for g in self.inflight.values()] + [t for t, _, _ in self.requeued]
            occ = [g.occ for g in self.inflight.values()] + [o for _, _, o in self.requeued]
            return blob, {"groups_started": self.started - len(self.inflight),
                          "tasks_taken": self.tasks_taken,
                          "pending_tasks": msgspec.to_builtins(pending),
                          "pending_occ": occ, "seq": self.seq, "parking": self.parking.state(),
                          "ledger": self._take_events()}

    async def take_events(self) -> list[dict[str, Any]]:
        """The ledger events since the last call (the driver appends them to ledger.jsonl)."""
        return self._take_events()

    def _take_events(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    def _event(self, kind: str, g: _Group, gid: str, **extra: Any) -> None:
        self._events.append({"ev": kind, "occ": g.occ, "gid": gid, "task": g.task.id, **extra})

    def _status(self) -> dict[str, Any]:
        return {
            "groups_started": self.started,
            "tasks_taken": self.tasks_taken,
            "in_flight_groups": len(self.inflight),
            "in_flight_episodes": sum(len(g.refs) for g in self.inflight.values()),
            "served_version": self.served_version,
            "tasks_parked": len(self.parking.parked),
            **{f"count/{k}": v for k, v in self.counts.items()},
        }

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        while self._failure is None:
            await self._admit()
            task, occ = self._next_task(self.started // self.cfg.groups_per_batch)
            gid = f"g{self.seq:07d}-{task.id}"
            self.seq += 1
            # a group on one env actor, in one call (GroupRollout: one RPC per group): its
            # members' identical answers are graded once there (envs/agent.py: concurrent
            # identical submissions share one sandboxed run)
            a, n = self._home_actor(task.id), self.cfg.group_size
            # priority = start order: the engines give the oldest groups' turns a row first,
            # so the batch the trainer waits for is not queued behind the next one's
            outs = self.env_actors[a].rollout_group.options(num_returns=n + 1).remote(
                task, gid, n, {**self.sampling, "priority": self.seq - 1})
            # every member's record is in the group's one list until it is re-run alone
            records, refs, actors = [outs[0]] * n, list(outs[1:]), [a] * n
            g = self.inflight[gid] = _Group(task, records, refs,
                                            self.started // self.cfg.groups_per_batch,
                                            actors=actors, occ=occ)
            self._event("start", g, gid)
            self.started += 1
            w = asyncio.get_running_loop().create_task(self._watch(gid), name=f"rl360-watch-{gid}")
            self._watchers.add(w)
            w.add_done_callback(self._watchers.discard)
            w.add_done_callback(self._on_done)

    def _next_task(self, batch: int) -> tuple[Task, int]:
        """A re-queued task once its batch is past the one it was cancelled from, else the
        next task of the stream; with its stream position."""
        if self.requeued and self.requeued[0][1] <= batch:
            task, _, occ = self.requeued.popleft()
            return task, occ
        while True:
            task = next(self.tasks)
            self.tasks_taken += 1
            if not self.parking.skip(task.id):
                return task, self.tasks_taken - 1
            # parked: its place in the stream is taken (a resume's skip-ahead counts it) and
            # the ledger says so (run_ledger.account: not lost)
            self._events.append({"ev": "park", "occ": self.tasks_taken - 1, "task": task.id})
            self.counts["park_skips"] += 1

    async def _admit(self) -> None:
        gpb = self.cfg.groups_per_batch
        while True:
            batch = self.started // gpb
            need = batch - self.cfg.max_staleness
            if need > self.served_version:
                if self.cfg.oversampling and (dropped := await self.buffer.take_dropped_stale.remote()):
                    # groups the buffer dropped as stale filled no batch: their slots go to
                    # new groups (as filtered groups' do), else the gate would hold every later
                    # group back by their number and async generation would stop overlapping
                    self.started -= dropped
                    self.counts["stale_slots_reopened"] += dropped
                    continue
                # short waits: a tail cancellation may move `started` back meanwhile
                self.served_version = await self.publisher.wait_applied.remote(
                    need, self.engine_replicas, 1.0)
                continue
            if len(self.inflight) >= self.cfg.max_in_flight_groups:
                await self._wait()
                continue
            wave_wait = self._rolling_wait()
            if wave_wait > 0:
                self.counts["rolling_start_waits"] += 1
                await self._wait(timeout_s=wave_wait)
                continue
            if self._queued_bound + len(self.inflight) + self._handing >= self.cfg.capacity_groups:
                self._queued_bound = await self.buffer.size.remote()
                if (self._queued_bound + len(self.inflight) + self._handing
                        >= self.cfg.capacity_groups):
                    self.counts["backpressure_waits"] += 1
                    await self._wait(timeout_s=0.5)
                    continue
            return

    def _rolling_wait(self) -> float:
        """Seconds until the rolling start's next wave may open a group (0: now). Waves of
        `size` groups every `interval_s`, until max_in_flight_groups groups were opened."""
        rs = self.cfg.rolling_start
        opened = self.seq - self._seq0
        if rs.size == 0 or opened >= self.cfg.max_in_flight_groups:
            return 0.0
        wave = opened // rs.size  # the wave this group belongs to
        return max(0.0, self._t0 + wave * rs.interval_s - time.monotonic())

    async def _wait(self, timeout_s: float | None = None) -> None:
        ev = self._wake
        try:
            await asyncio.wait_for(ev.wait(), timeout_s)
        except TimeoutError:
            pass

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def _member(self, gid: str, g: _Group, i: int,
                      first: list[EpisodeRecord] | None = None) -> EpisodeRecord:
        """Episode i's record (only the record: its trajectory stays where the env actor put
        it): from `first`, the group's list of records, or its own re-run's ref. An episode
        that failed on the infrastructure, or whose env actor died under it, is re-run on the
        next actor, `train.episode_reruns` times at most, so a transient failure does not
        shrink its group (the GRPO baseline stays over group_size)."""
        rec = first[i] if first is not None else await self._record(gid, g, g.records[i], i)
        if rec.status != "infra_error" or g.reruns[i] >= self.cfg.episode_reruns:
            return rec
        g.reruns[i] += 1
        self.counts["episodes_rerun"] += 1
        self._event("rerun", g, gid, member=i, why=(rec.error or "")[:120])
        g.actors[i] = self._next_actor(avoid=g.actors[i])
        g.records[i], g.refs[i] = self.env_actors[g.actors[i]].rollout.remote(
            g.task, gid, self.sampling)
        return await self._member(gid, g, i)

    HOME_TASKS = 100_000  # task ids whose env actor is remembered (LRU)

    def _home_actor(self, task_id: str) -> int:
        """The env actor of `task_id`'s groups: the one its earlier groups ran on while that
        actor is up (it lost no episode in the last LOST_COOLDOWN_S), else the next in the
        round robin, which becomes the task's home."""
        a = self._home.get(task_id)
        if a is None or time.monotonic() - self._lost_at.get(a, -math.inf) <= LOST_COOLDOWN_S:
            a = self._next_actor()
        self._home[task_id] = a
        self._home.move_to_end(task_id)
        if len(self._home) > self.HOME_TASKS:
            self._home.popitem(last=False)
        return a

    def _next_actor(self, avoid: int = -1) -> int:
        """Round robin over the env actors, skipping one that lost an episode in the last
        LOST_COOLDOWN_S (it is dead or restarting) and `avoid`, while another is available."""
        n = len(self.env_actors)
        now = time.monotonic()
        for _ in range(n):
            a = self._rr % n
            self._rr += 1
            if a != avoid and now - self._lost_at.get(a, -math.inf) > LOST_COOLDOWN_S:
                return a
        a = self._rr % n
        self._rr += 1
        return a

    def _breaker(self, records: list[EpisodeRecord]) -> None:
        """Fail the controller when the circuit breaker trips on a finished group."""
        why = self.breaker.observe(records)
        if why:
            self._failure = RuntimeError(why)

    async def _record(self, gid: str, g: _Group, ref: Any, i: int) -> Any:
        """The object behind `ref` (a member's record, or with i < 0 the group's list of
        records); when the env actor died or its task broke (not the model's doing), the
        infra_error record(s) that say so."""
        try:
            return await ref
        except ray.exceptions.TaskCancelledError:
            raise
        except Exception as exc:
            self.counts["episodes_actor_lost"] += 1 if i >= 0 else len(g.records)
            self._lost_at[g.actors[max(i, 0)]] = time.monotonic()
            lost = EpisodeRecord(task_id=g.task.id, group_id=gid, status="infra_error",
                                 reward=None, error=f"env actor lost: {type(exc).__name__}",
                                 domain=task_domain(g.task))
            return lost if i >= 0 else [lost] * len(g.records)

    async def _watch(self, gid: str) -> None:
        g = self.inflight[gid]
        try:
            first = await self._record(gid, g, g.records[0], -1)  # the group's records, once
            records = list(await asyncio.gather(*(self._member(gid, g, i, first)
                                                  for i in range(len(g.records)))))
        except (ray.exceptions.TaskCancelledError, asyncio.CancelledError):
            return  # tail-cancelled: the canceller re-queued the task
        self._breaker(records)
        async with self._handoff:  # a checkpoint sees this group queued or pending, not both
            await self._hand_over(gid, g, records)

    async def _hand_over(self, gid: str, g: _Group, records: list[EpisodeRecord]) -> None:
        if self.inflight.pop(gid, None) is None:
            return
        self.done_times[g.batch].append(time.monotonic() - g.started)
        oldest = min((x.batch for x in self.inflight.values()), default=g.batch)
        for old in [b for b in self.done_times if b < oldest]:  # bounded: no group needs them
            del self.done_times[old]
        record_bytes = sum(len(msgspec.msgpack.encode(r)) for r in records)
        batch = -1 if self.cfg.oversampling else g.batch
        self._handing = 1  # out of `inflight`, perhaps not yet in the buffer: admission counts it
        try:
            queued = await self.buffer.add_group.remote(gid, g.task.id, records, [g.refs], batch)
        finally:
            self._handing = 0
        self._queued_bound += bool(queued)
        self._event("settle", g, gid, queued=bool(queued),
                    infra=sum(r.status == "infra_error" for r in records))
        if self.parking.settled(g.task.id, records):
            self.counts["tasks_parked"] += 1
            log.info("parked task %s: %d all-failed groups in a row", g.task.id,
                     self.parking.streak[g.task.id])
        if not queued:
            # filtered (no reward variance, or all infra failures): with oversampling its batch
            # slot goes to another group (or the staleness gate would wait for a batch that
            # never fills); without, the batch is whatever survived
            if self.cfg.oversampling:
                self.started -= 1
            self.counts["groups_filtered"] += 1
        # counted together: a status read while the buffer takes the group sees neither
        self.counts["record_bytes"] += record_bytes
        self.counts["groups_done"] += 1
        self._notify()

    async def _tail_loop(self) -> None:
        gpb = self.cfg.groups_per_batch
        while True:
            await asyncio.sleep(0.25)
            if not self.inflight:
                continue
            oldest = min(g.batch for g in self.inflight.values())
            done = self.done_times.get(oldest, [])
            if len(done) < gpb - self.cfg.tail.keep:
                continue
            limit = self.cfg.tail.factor * statistics.median(done)
            now = time.monotonic()
            for gid, g in list(self.inflight.items()):
                if g.batch == oldest and now - g.started > limit:
                    self.inflight.pop(gid)
                    cancel_episodes(g.records)  # each episode task once, not its clean-up
                    self.requeued.append((g.task, g.batch + 1, g.occ))  # not the batch it stalled
                    self._event("requeue", g, gid)
                    self.counts["tail_cancelled_groups"] += 1
                    log.info("tail-cancelled %s after %.1fs (limit %.1fs)", gid, now - g.started, limit)
                    if self.cfg.oversampling:
                        self.started -= 1  # its slot in the batch goes to the next group
                    else:
                        await self.buffer.skip_group.remote(g.batch)
            self._notify()
