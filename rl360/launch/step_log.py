"""What the train driver logs besides the step's numbers: a few sampled trajectories per step
(`train.log_trajectories`) and the held-out evaluation that runs alongside training
(`train.eval_every`).

Both keep the driver's data path small: the trajectory log fetches only the N trajectories it
writes; the evaluation fetches only the episodes' EpisodeRecords (their token data is dropped).
"""

from __future__ import annotations

import collections
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray

from rl360.actors.reward_stats import episode_metrics
from rl360.envs.tasks import iter_tasks
from rl360.types import EpisodeRecord, Task, Trajectory

EVAL_PREFIX = "eval-"  # group id prefix of evaluation episodes


def trajectory_row(traj: Trajectory, step: int, advantage: float, policy_version: int,
                   decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """One line of trajectories.jsonl: the decoded episode (whole, and each generated span),
    its reward and components, and a summary of its tokens' policy versions."""
    spans: list[list[int]] = []
    prev = 0
    for tok, m in zip(traj.tokens, traj.mask, strict=True):
        if m and not prev:
            spans.append([])
        if m:
            spans[-1].append(tok)
        prev = m
    gen = [v for v, m in zip(traj.versions, traj.mask, strict=True) if m and v is not None]
    counts = collections.Counter(gen)
    r = traj.reward
    return {
        "step": step, "task_id": traj.task_id, "group_id": traj.group_id, "domain": traj.domain,
        "status": traj.status, "error": traj.error,
        "reward": r.value if r else None, "components": dict(r.components) if r else {},
        "advantage": advantage, "turns": traj.turns, "tokens": len(traj.tokens),
        "loss_tokens": int(sum(traj.mask)),
        "versions": {"min": min(gen) if gen else None, "max": max(gen) if gen else None,
                     "counts": {str(v): n for v, n in sorted(counts.items())},
                     "staleness_max": policy_version - min(gen) if gen else None},
        "text": decode(list(traj.tokens)),
        "generated": [decode(s) for s in spans],
    }


class TrajectoryLog:
    """`n` trajectories of each step's batch, sampled (seeded by the run seed and the step),
    fetched and written to `path` as JSONL."""

    def __init__(self, path: Path, n: int, model_path: str, seed: int) -> None:
        self.path, self.n, self.model_path, self.seed = path, n, model_path, seed
        self._tok: Any = None

    def _decode(self, ids: list[int]) -> str:
        if self._tok is None:
            from rl360.policies.loading import load_tokenizer

            self._tok = load_tokenizer(self.model_path)
        return str(self._tok.decode(ids, skip_special_tokens=False))

    def write(self, batch: Any, step: int) -> int:
        """Write up to n members of `batch` (a RefBatch); returns how many were written."""
        if self.n <= 0 or not batch.members:
            return 0
        rng = random.Random(self.seed * 1_000_003 + step)
        picked = rng.sample(batch.members, min(self.n, len(batch.members)))
        refs = [m.ref for m in picked if not isinstance(m.ref, Trajectory)]
        fetched = iter(ray.get(refs)) if refs else iter(())
        trajs = [m.ref if isinstance(m.ref, Trajectory) else next(fetched) for m in picked]
        with self.path.open("a") as f:
            for m, t in zip(picked, trajs, strict=True):
                row = trajectory_row(t, step, m.advantage, batch.policy_version, self._decode)
                f.write(json.dumps(row) + "\n")
        return len(picked)


def eval_metrics(records: Sequence[EpisodeRecord]) -> dict[str, float]:
    """eval/* figures of finished evaluation episodes (one attempt per task: pass@1 is the
    pass rate over the scored ones)."""
    m = episode_metrics(records, by_task=False)
    out: dict[str, float] = {}
    for k, v in m.items():
        if k.startswith("component/") or k.endswith(("tokens", "loss_tokens")):
            continue
        out[f"eval/{k.replace('pass_rate', 'pass@1')}"] = v
    gen = [r.max_version for r in records if r.loss_tokens]
    if gen:
        out["eval/policy_version_min"] = min(r.min_version for r in records if r.loss_tokens)
        out["eval/policy_version_max"] = max(gen)
    return out


def load_eval_tasks(paths: list[str], limit: int, every: int) -> list[Task]:
    """The held-out tasks of `train.eval_every` (ValueError naming the key when there are none
    or a task file is bad)."""
    if not every:
        return []
    tasks: list[Task] = []
    try:
        for p in paths:
            tasks.extend(iter_tasks(p))
    except ValueError as exc:
        raise ValueError(f"train.eval_every: eval.tasks: {exc}") from None
    tasks = tasks[:limit] if limit else tasks
    if not tasks:
        raise ValueError(f"train.eval_every = {every} needs held-out tasks: eval.tasks {paths} "
                         "has none")
    return tasks


EVAL_PRIORITY = 2**31 - 1  # SamplingParams.priority: lower goes first


class TrainEval:
    """The held-out task set, run on the current policy every `every` steps by the env actors
    next to the rollouts (group ids `eval-<step>-<i>`); `poll` returns the eval/* metrics once
    every episode of the running evaluation is done, never waiting for them."""

    def __init__(self, every: int, tasks: list[Task], env_actors: list[Any],
                 sampling: dict[str, Any]) -> None:
        # behind every training group in the engines' queues (those go by start order): the
        # evaluation runs in spare rows and never holds up the batch the trainer waits for
        self.every, self.tasks, self.actors = every, tasks, env_actors
        self.sampling = {**sampling, "priority": EVAL_PRIORITY}
        self.pending: list[Any] = []
        self.started_step = 0

    def maybe_start(self, step: int) -> bool:
        """Start an evaluation at `step` when it is due and none is running."""
        if not self.every or step % self.every or self.pending:
            return False
        self.started_step = step
        for i, task in enumerate(self.tasks):
            actor = self.actors[i % len(self.actors)]
            record, _traj = actor.rollout.remote(task, f"{EVAL_PREFIX}{step}-{i}", self.sampling)
            self.pending.append(record)
        return True

    def poll(self, timeout_s: float = 0.0) -> dict[str, float]:
        """The finished evaluation's metrics ({} while one is running or none was started)."""
        if not self.pending:
            return {}
        deadline = time.monotonic() + timeout_s
        while True:
            ready, _ = ray.wait(self.pending, num_returns=len(self.pending),
                                timeout=max(0.0, deadline - time.monotonic()))
            if len(ready) == len(self.pending) or time.monotonic() >= deadline:
                break
        if len(ready) < len(self.pending):
            return {}
        records: list[EpisodeRecord] = ray.get(self.pending)
        self.pending = []
        return {**eval_metrics(records), "eval/step": self.started_step}
