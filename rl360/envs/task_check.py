"""Can a recipe's tasks be set up? Checked before anything starts (no Ray, no sandbox).

    check_tasks(["examples/tasks"], recipe.env)   # ValueError: one line, file and kind

For each task file (a .jsonl file or a Harbor task dir) and each task in it: the env its kind
names (or `env.env`) resolves and accepts `env.params`, and the sandbox it asks for can run
here (`Env.sandbox_spec` and the backend choice: a refused task, e.g. one that needs Docker,
refuses here). An agent function (`env.agent_fn`) must resolve to a callable; it needs no env
class (its episodes get a plain sandbox) unless `env.env` names one. The first problem ends
the check with one line that names the task file, the task's kind and what is wrong.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from rl360.envs.api import Env, TaskRefused, choose_backend
from rl360.envs.registry import build_env_for, resolve
from rl360.envs.tasks import iter_code_tasks, iter_harbor_tasks, iter_tasks
from rl360.recipe import EnvSection
from rl360.types import Task


def tasks_by_file(path: str | os.PathLike[str]) -> Iterator[tuple[str, Task]]:
    """(task file, task) for every task under `path`, in `iter_tasks`'s order: a .jsonl file,
    a Harbor task dir, or a folder of both (one level deep)."""
    p = Path(path)
    if not p.is_dir() or (p / "task.toml").is_file():
        for t in iter_tasks(p):  # its own one-line errors for a missing path or a bad suffix
            yield str(p), t
        return
    for child in sorted(p.iterdir()):
        if child.is_file() and child.suffix == ".jsonl":
            for t in iter_code_tasks(child):
                yield str(child), t
        elif child.is_dir():
            for t in iter_harbor_tasks(child):
                yield t.data.get("path", str(child)), t


def check_tasks(paths: list[str], env: EnvSection, limit: int = 0) -> int:
    """Raise ValueError naming the task file and kind of the first task that cannot be set up
    (the first `limit` tasks when limit > 0, as the rollout takes them); returns how many were
    checked."""
    if env.agent_fn:
        try:
            fn = resolve(env.agent_fn)
        except ValueError as exc:
            raise ValueError(f"env.agent_fn: {exc}") from None
        if not callable(fn):
            raise ValueError(f"env.agent_fn {env.agent_fn!r} is not callable")
    envs: dict[str, Env | None] = {}
    n = 0
    for path in paths:
        for where, task in tasks_by_file(path):
            if limit and n >= limit:
                return n
            n += 1
            try:
                if task.kind not in envs:
                    plain = bool(env.agent_fn) and not env.env
                    envs[task.kind] = None if plain else build_env_for(env.env, env.params,
                                                                       task.kind)
                built = envs[task.kind]
                if built is not None:
                    spec = built.sandbox_spec(task, env.limits)
                    choose_backend(spec, env.sandbox, task, env.allow_unsandboxed)
            except (TaskRefused, ValueError) as exc:
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise ValueError(f"{where}: tasks of kind {task.kind!r} cannot be set up: "
                                 f"{why}") from None
    return n
