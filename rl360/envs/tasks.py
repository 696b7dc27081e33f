"""Task formats: tasks in JSONL (streamed a line at a time) and Harbor task directories.

A JSONL line is either a full task record {"id", "prompt", "kind", "data"} (any env kind: what
`rl360 eval --calibrate` writes, and e.g. examples/search/tasks.jsonl) or a code task
{"id", "instruction" | "prompt", "entry_point"?, "tests": [assert lines] | "test code",
"reference"? (or "solution"), ...extra fields kept in Task.data}. Every format may declare the
task's reward range, `reward_range = [low, high]` (default [0, 1]; rl360.rewards.bounds).

Harbor task dir: instruction.md, task.toml ([agent] timeout_sec, [verifier] timeout_sec / env /
reward_range, [environment] cpus, memory_mb (or memory = "2G"), storage_mb (or storage), network_mode
("no-network" | "public" | "allowlist") or allow_internet, docker_image, workdir (RL360: where
the agent starts, default /app)), tests/test.sh (+ files), optional solution/solve.sh,
optional environment/ (a Dockerfile means the task needs its own image; RL360 also copies
environment/files/** into the work dir when there is no Dockerfile).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from rl360.rewards.bounds import parse_range
from rl360.types import Task


class TaskFormatError(ValueError):
    """A task file is malformed; the message names the file (and line)."""


class CodeTaskRecord(msgspec.Struct):
    id: str
    tests: list[str] | str
    instruction: str | None = None
    prompt: str | None = None
    entry_point: str | None = None
    reference: str | None = None
    solution: str | None = None


_CODE_FIELDS = set(CodeTaskRecord.__struct_fields__)


def code_task(record: dict[str, Any], where: str = "<record>") -> Task:
    """A Task from one decoded code-task record."""
    try:
        rec = msgspec.convert(record, CodeTaskRecord)
    except msgspec.ValidationError as e:
        raise TaskFormatError(f"{where}: {e}") from None
    prompt = rec.instruction or rec.prompt
    if not prompt:
        raise TaskFormatError(f"{where}: task {rec.id!r} has no instruction/prompt")
    if isinstance(rec.tests, list) and not rec.tests:
        raise TaskFormatError(f"{where}: task {rec.id!r} has no tests")
    data: dict[str, Any] = {k: v for k, v in record.items() if k not in _CODE_FIELDS}
    data.update(tests=rec.tests, entry_point=rec.entry_point)
    ref = rec.reference if rec.reference is not None else rec.solution
    if ref is not None:
        data["reference"] = ref
    return Task(id=rec.id, prompt=prompt, kind="code", data=_checked_range(data, where))


def _checked_range(data: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` with its reward_range (when given) checked and stored as [low, high] floats."""
    if "reward_range" in data:
        try:
            rng = parse_range(data["reward_range"], where)
        except ValueError as e:
            raise TaskFormatError(str(e)) from None
        data["reward_range"] = [rng.low, rng.high]
    return data


def full_task(record: dict[str, Any], where: str = "<record>") -> Task:
    """A Task from a full task record {"id", "prompt", "kind", "data"}."""
    try:
        task = msgspec.convert(record, Task)
    except msgspec.ValidationError as e:
        raise TaskFormatError(f"{where}: not a task record {{id, prompt, kind, data}}: {e}") from None
    if not task.id or not task.prompt or not task.kind:
        raise TaskFormatError(f"{where}: a task record needs a non-empty id, prompt and kind")
    _checked_range(task.data, where)
    return task


def iter_code_tasks(path: str | os.PathLike[str]) -> Iterator[Task]:
    """Stream tasks from a JSONL file, one line at a time (blank lines skipped): full task
    records (a line with "kind" and "data") or code task records."""
    decoder = msgspec.json.Decoder()
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = decoder.decode(line)
            except msgspec.DecodeError as e:
                raise TaskFormatError(f"{where}: not JSON: {e}") from None
            if not isinstance(record, dict):
                raise TaskFormatError(
                    f"{where}: expected a JSON object, got {type(record).__name__}"
                )
            task = full_task(record, where) if "kind" in record and "data" in record \
                else code_task(record, where)
            yield with_domain(task, Path(path).resolve().parent.name)


def with_domain(task: Task, directory: str) -> Task:
    """`task` with `data["domain"]` set (for per-domain metrics): its own `domain`, else its
    `family`, else the name of the directory its task file (or task dir) lies in."""
    if not task.data.get("domain"):
        task.data["domain"] = str(task.data.get("family") or directory or "unknown")
    return task


# ----------------------------------------------------------------------------- Harbor

_SIZE_UNITS = {"": 1, "k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}


def _mb(value: Any, key: str, where: str) -> int | None:
    """An int of MiB from 2048 or "2G" / "512M"."""
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, str):
        s = value.strip().lower().removesuffix("b").removesuffix("i")
        unit = s[-1] if s and s[-1] in "kmgt" else ""
        try:
            return int(float(s[: len(s) - len(unit)]) * _SIZE_UNITS[unit])
        except ValueError:
            pass
    raise TaskFormatError(f"{where}: {key} must be a size like 2048 or '2G', got {value!r}")


def _section(toml: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    sec = toml.get(name, {})
    if not isinstance(sec, dict):
        raise TaskFormatError(f"{where}: [{name}] must be a table")
    return sec


def _number(sec: dict[str, Any], key: str, default: float | None, where: str) -> float | None:
    v = sec.get(key, default)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v <= 0):
        raise TaskFormatError(f"{where}: {key} must be a positive number, got {v!r}")
    return None if v is None else float(v)


def load_harbor_task(path: str | os.PathLike[str]) -> Task:
    """A Task (kind "harbor") from a Harbor task directory."""
    root = Path(path)
    where = str(root / "task.toml")
    for need in ("instruction.md", "task.toml", "tests/test.sh"):
        if not (root / need).is_file():
            raise TaskFormatError(f"harbor task {root}: missing {need}")
    try:
        toml = tomllib.loads((root / "task.toml").read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskFormatError(f"{where}: {e}") from None
    agent = _section(toml, "agent", where)
    verifier = _section(toml, "verifier", where)
    env = _section(toml, "environment", where)
    network_mode = env.get("network_mode")
    if network_mode is None:
        network_mode = "public" if env.get("allow_internet") is True else "no-network"
    if network_mode not in ("no-network", "public", "allowlist"):
        raise TaskFormatError(f"{where}: network_mode must be no-network, public or allowlist")
    name = toml.get("task", {}).get("name") if isinstance(toml.get("task"), dict) else None
    data: dict[str, Any] = {
        "path": str(root.resolve()),
        "agent_timeout_sec": _number(agent, "timeout_sec", 600.0, where),
        "verifier_timeout_sec": _number(verifier, "timeout_sec", 600.0, where),
        "verifier_env": {str(k): str(v) for k, v in (verifier.get("env") or {}).items()},
        "reward_range": verifier.get("reward_range", [0.0, 1.0]),
        "cpus": _number(env, "cpus", None, where),
        "memory_mb": _mb(env.get("memory_mb", env.get("memory")), "memory_mb", where),
        "storage_mb": _mb(env.get("storage_mb", env.get("storage")), "storage_mb", where),
        "network_mode": network_mode,
        "docker_image": env.get("docker_image") or None,
        "env": {str(k): str(v) for k, v in (env.get("env") or {}).items()},
        "workdir": env.get("workdir", "/app"),
        "has_dockerfile": (root / "environment" / "Dockerfile").is_file(),
        "has_solution": (root / "solution" / "solve.sh").is_file(),
    }
    if not str(data["workdir"]).startswith("/"):
        raise TaskFormatError(f"{where}: environment.workdir must be an absolute path")
    _checked_range(data, f"{where}: [verifier]")
    return with_domain(Task(
        id=str(name or root.name),
        prompt=(root / "instruction.md").read_text(),
        kind="harbor",
        data=data,
    ), root.resolve().parent.name)


def iter_harbor_tasks(root: str | os.PathLike[str]) -> Iterator[Task]:
    """Every Harbor task directory under `root` (itself, or its sorted subdirectories)."""
    base = Path(root)
    if (base / "task.toml").is_file():
        yield load_harbor_task(base)
        return
    for sub in sorted(p for p in base.iterdir() if p.is_dir()):
        if (sub / "task.toml").is_file():
            yield load_harbor_task(sub)


def iter_tasks(path: str | os.PathLike[str]) -> Iterator[Task]:
    """Tasks from a .jsonl file, a Harbor task dir, or a folder holding *.jsonl files and/or
    Harbor task dirs (searched one level deep: e.g. examples/tasks/{code.jsonl,harbor/})."""
    p = Path(path)
    if p.is_file():
        if p.suffix != ".jsonl":
            raise TaskFormatError(f"{p}: task files must be .jsonl")
        yield from iter_code_tasks(p)
        return
    if not p.is_dir():
        raise TaskFormatError(f"{p}: no such task file or directory")
    if (p / "task.toml").is_file():
        yield load_harbor_task(p)
        return
    for child in sorted(p.iterdir()):
        if child.is_file() and child.suffix == ".jsonl":
            yield from iter_code_tasks(child)
        elif child.is_dir():
            yield from iter_harbor_tasks(child)
