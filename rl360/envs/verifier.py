"""Harbor verification: the clean room, the verifier's clean start and its bounded reward, the
one implementation for every way an agent works on a Harbor task (the built-in tool loop's
`HarborEnv.verify`, the agent worker env that runs external agent programs).

    reward = await verify_harbor(sandbox, task, limit_s=600.0)   # VerifierError: scored 0

1. The clean room, on a budget of its own (`PREP_TIMEOUT_S`, outside the verifier's): every
   process the agent left in the sandbox is killed (`Sandbox.sweep`, daemons included), /logs,
   /tests and /verifier are emptied, and /tests is refilled from the task's tests/.
2. The clean start: `bash /tests/test.sh` runs with /tests as its cwd under `env -i`, in an
   environment built here and nowhere else: the backend's own (`Sandbox.clean_env`: PATH,
   locale), a fresh empty HOME and TMPDIR under /verifier, PYTHONNOUSERSITE=1 (no user site)
   and PYTHONSAFEPATH=1 (neither the cwd nor a script's folder goes on sys.path, as with
   `python3 -I`; Python >= 3.11), then what the task sets ([environment].env, [verifier].env).
   Nothing of the agent's tree is its HOME, cwd, user site or import path, so a `.pth` file in
   the agent's ~/.local or a module that shadows the standard library in the work dir never
   runs inside the verifier: the agent's files are data the tests read.
3. The reward: /logs/verifier/reward.txt (one number) or reward.json (a flat object of numbers;
   its "reward" entry, else the mean), clamped to the task's reward range (`[verifier]
   reward_range`, default [0, 1]; component and counter `reward_clamped`). Any processes the
   verifier left are killed before the reward is read.
4. What the agent can cause is scored, never an infrastructure error: `VerifierError` (a
   `ModelFault`: status error, reward 0) when no valid reward was written, when the verifier
   overran its limit (even after writing a reward), when the sandbox failed during verification,
   or when the clean room could not be made in its budget.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

from rl360.envs.api import ModelFault
from rl360.envs.sandbox import Sandbox, SandboxError
from rl360.rewards.bounds import bound_reward, task_range
from rl360.types import Reward, Task

LOGS_DIR, TESTS_DIR, VERIFIER_DIR = "/logs", "/tests", "/verifier"
SCRATCH_DIRS = [LOGS_DIR, TESTS_DIR, "/solution", VERIFIER_DIR]  # private dirs a task needs
VERIFIER_HOME, VERIFIER_TMP = f"{VERIFIER_DIR}/home", f"{VERIFIER_DIR}/tmp"
REWARD_CAP = 65536  # bytes of reward.txt / reward.json read
PREP_TIMEOUT_S = 120.0  # the clean room: sweep, empty, copy the tests
EXEC_GRACE_S = 10.0  # beyond the verifier's limit, for the sandbox to report the kill
# flags a clean Python start needs that only the environment can give to every python3 the
# test script starts (`-I` would have to be on each command line)
CLEAN_PYTHON = {"PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1", "PYTHONDONTWRITEBYTECODE": "1"}


class VerifierError(ModelFault):
    """The task's verifier did not produce a (valid) reward after the agent ran."""


def _host_files(root: Path) -> list[tuple[str, bytes, int]]:
    """(relative path, bytes, mode) of every file under `root` (none when it is missing)."""
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            mode = 0o755 if p.stat().st_mode & 0o111 else 0o644
            out.append((p.relative_to(root).as_posix(), p.read_bytes(), mode))
    return out


async def copy_tree(sandbox: Sandbox, src: Path, dest: str) -> int:
    """Copy a host directory into the sandbox (executable bits kept); returns the file count."""
    files = await asyncio.to_thread(_host_files, src)
    for rel, data, mode in files:
        await sandbox.write_file(f"{dest.rstrip('/')}/{rel}", data, mode=mode)
    return len(files)


def verifier_env(sandbox: Sandbox, task: Task) -> dict[str, str]:
    """The whole environment of the verifier's processes: the backend's own, a fresh HOME and
    TMPDIR, the clean-Python flags, then the task's [environment].env and [verifier].env. No
    PYTHON* variable of any other origin."""
    base = {k: v for k, v in sandbox.clean_env().items() if not k.startswith("PYTHON")}
    return {**base, "HOME": VERIFIER_HOME, "TMPDIR": VERIFIER_TMP, **CLEAN_PYTHON,
            **task.data.get("env", {}), **task.data.get("verifier_env", {})}


def clean_argv(env: dict[str, str], argv: list[str]) -> list[str]:
    """`argv` started with exactly `env` (`env -i`: the exec's inherited environment dropped)."""
    return ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv]


def parse_reward(text: str, kind: str) -> Reward:
    """The reward in reward.txt ("txt") or reward.json ("json"); VerifierError when it holds
    no finite number."""
    if kind == "txt":
        try:
            value = float(text.strip().split()[0])
        except (ValueError, IndexError):
            raise VerifierError(f"reward.txt does not hold a number: {text[:100]!r}") from None
        if not math.isfinite(value):
            raise VerifierError(f"reward.txt holds a non-finite number: {value}")
        return Reward(value=value, components={"reward": value})
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise VerifierError(f"reward.json is not JSON: {e}") from None
    if not isinstance(data, dict) or not data:
        raise VerifierError("reward.json must be a non-empty flat object of numbers")
    comps: dict[str, float] = {}
    for k, v in data.items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise VerifierError(f"reward.json entry {k!r} is not a number: {v!r}")
        if not math.isfinite(v):
            raise VerifierError(f"reward.json entry {k!r} is not finite: {v!r}")
        comps[str(k)] = float(v)
    value = comps["reward"] if "reward" in comps else sum(comps.values()) / len(comps)
    return Reward(value=value, components=comps)


async def clean_room(sandbox: Sandbox, tests: Path) -> int:
    """Kill every process of the sandbox but its own helper, empty /logs, /tests and /verifier,
    refill /tests from `tests`; the count of stray processes killed."""
    stray = await sandbox.sweep()
    dirs = f"{LOGS_DIR} {TESTS_DIR} {VERIFIER_DIR}"
    res = await sandbox.exec(
        f"chmod -R u+rwX {dirs} 2>/dev/null; find {dirs} -mindepth 1 -delete; "
        f"mkdir -p {LOGS_DIR}/verifier {LOGS_DIR}/agent {VERIFIER_HOME} {VERIFIER_TMP}",
        timeout=PREP_TIMEOUT_S, cwd="/")
    if not res.ok:
        raise VerifierError(f"the clean room could not be made: {(res.stderr or res.stdout)[-300:]}")
    await copy_tree(sandbox, tests, TESTS_DIR)
    return stray


async def _read_reward(sandbox: Sandbox) -> Reward | None:
    for kind in ("txt", "json"):
        try:
            raw = await sandbox.read_file(f"{LOGS_DIR}/verifier/reward.{kind}", max_bytes=REWARD_CAP)
        except OSError:
            continue
        return parse_reward(raw.decode(errors="replace"), kind)
    return None


async def verify_harbor(sandbox: Sandbox, task: Task, limit_s: float | None = None,
                        tests: Path | None = None) -> Reward:
    """Run the task's verifier in `sandbox` after the agent is done (see the module docstring)
    and return its reward, bounded to the task's range. `limit_s`: the verifier's own limit
    (default the task's verifier_timeout_sec, else 600 s); `tests`: the host folder copied to
    /tests (default the task's tests/). Raises VerifierError for what the agent can cause."""
    limit = float(limit_s or task.data.get("verifier_timeout_sec") or 600.0)
    tests = tests or Path(task.data["path"]) / "tests"
    try:
        stray = await asyncio.wait_for(clean_room(sandbox, tests), PREP_TIMEOUT_S)
    except TimeoutError:
        raise VerifierError(f"the clean room was not ready within {PREP_TIMEOUT_S:g}s") from None
    except SandboxError as e:
        raise VerifierError(f"the sandbox failed making the clean room: {e}") from e
    argv = clean_argv(verifier_env(sandbox, task), ["bash", f"{TESTS_DIR}/test.sh"])
    try:
        res = await asyncio.wait_for(sandbox.exec(argv, timeout=limit, cwd=TESTS_DIR),
                                     limit + EXEC_GRACE_S)
        left = await sandbox.sweep()  # nothing the verifier started writes after this
        reward = None if res.timed_out else await _read_reward(sandbox)
    except TimeoutError:
        raise VerifierError(f"harbor task {task.id!r}: test.sh overran its {limit:g}s") from None
    except SandboxError as e:
        raise VerifierError(f"harbor task {task.id!r}: the sandbox failed during "
                            f"verification: {e}") from e
    tail = (res.stdout[-1500:] + res.stderr[-1500:]).strip()
    if res.timed_out:
        raise VerifierError(f"harbor task {task.id!r}: test.sh overran its {limit:g}s: "
                            f"{tail[-500:]}")
    if reward is None:
        raise VerifierError(f"harbor task {task.id!r}: test.sh exited {res.exit_code} without "
                            f"writing a reward: {tail[-500:]}")
    reward, clamped = bound_reward(reward, task_range(task))
    reward.info.update(verifier_exit_code=res.exit_code, verifier_output=tail,
                       agent_procs_killed=stray, verifier_procs_killed=left)
    if clamped:
        reward.info["reward_range"] = list(task.data.get("reward_range") or [0.0, 1.0])
    return reward
