"""The task stream the rollout controller takes tasks from: the task files, pass after pass,
each pass shuffled through a window of tasks seeded by the run's seed and the pass (a resume
replays it)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from rl360.envs.tasks import iter_tasks
from rl360.types import Task


def task_stream(paths: list[str], limit: int, window: int = 0, seed: int = 0) -> Iterator[Task]:
    """The tasks of `paths` (the first `limit` of each pass when > 0), pass after pass. With
    `window` > 0 each pass is shuffled through a buffer of that many tasks (a full shuffle
    when the pass is no longer than the window), seeded by (seed, pass): the same seed gives
    the same stream, which is what a resume's skip-ahead relies on."""
    for n_pass in itertools.count():
        rng = random.Random(f"{seed}:{n_pass}")
        pool: list[Task] = []
        n = 0
        for t in one_pass(paths, limit):
            n += 1
            if window <= 0:
                yield t
                continue
            pool.append(t)
            if len(pool) >= window:
                i = rng.randrange(len(pool))
                pool[i], pool[-1] = pool[-1], pool[i]
                yield pool.pop()
        rng.shuffle(pool)
        yield from pool
        if n == 0:
            raise ValueError(f"no tasks in {paths}")


def one_pass(paths: list[str], limit: int) -> Iterator[Task]:
    n = 0
    for p in paths:  # the files are re-read each pass, never loaded whole
        for t in iter_tasks(p):
            yield t
            n += 1
            if limit and n >= limit:
                return
