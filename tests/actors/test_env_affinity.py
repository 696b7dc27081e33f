"""env.cpu_affinity: an env actor pins its own threads, and the sandboxes it starts (their
commands) inherit the pinning. Run in a child process: pinning is process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rl360.policies.affinity import pin_to_cpus

CODE = """
import asyncio, os
from rl360.actors.env_pool import EnvActor
from rl360.envs.api import open_sandbox
from rl360.envs.registry import build_env_for
from rl360.recipe import EnvSection
from rl360.types import Task

cfg = EnvSection(sandbox="process", allow_unsandboxed=True, cpu_affinity=[0])
actor = EnvActor(cfg, {}, [], "ns", "")
task = Task(id="t", prompt="x", data={"tests": ["assert f() == 1"], "entry_point": "f"})

async def main():
    sb = open_sandbox(build_env_for(cfg.env, cfg.params, task.kind), task, "process", cfg.limits, True)
    async with sb:
        r = await sb.exec("grep Cpus_allowed_list /proc/self/status")
    return r.stdout

threads = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}
print(sorted(threads), asyncio.run(main()).split()[-1])
"""


def test_env_actor_and_its_sandboxes_run_on_the_given_cores() -> None:
    if len(__import__("os").sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to tell a pinning from none")
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[(0,)]", "0"], out.stdout


def test_a_missing_core_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"^env.cpu_affinity: no CPU core 4096"):
        pin_to_cpus([4096], "env.cpu_affinity")
