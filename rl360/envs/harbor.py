"""HarborEnv: Harbor-format tasks (Terminal-Bench style). The agent works in the sandbox with
the built-in tools; then the task's verifier runs through `rl360.envs.verifier.verify_harbor`
(the same code as for an agent program run by the agent worker): a clean room (every process the
agent left killed, /logs and /tests emptied, tests/ copied to /tests), then `bash /tests/test.sh`
with a clean start (a fresh HOME, cwd /tests, no user site, nothing implicit on sys.path, the
environment the task sets), which writes /logs/verifier/reward.txt (one number) or reward.json (a
flat dict of named numbers; its "reward" entry, else the mean, is the value), bounded to the
task's reward range. The script's exit code is ignored. A verifier that writes no reward, overruns
or breaks its sandbox after the agent ran is the agent's doing (it can break what test.sh
needs): a scored failure (status error, reward 0), not an infra_error.

Sandbox: the task's memory, storage, cpus, network and timeouts are honoured; /logs, /tests,
/solution and /verifier are private writable dirs next to the work dir (default /app). A task
with its own image (docker_image, or environment/Dockerfile: built once per content) runs only
on the docker backend; where no Docker engine runs it is refused up front, naming the task and
the reason.

Recipe parameters (`env.params`): system_prompt ({workdir} is filled in), the tools (default:
the built-in ones plus `search` when the stack runs it), max_output_chars, and format_penalty
(> 0: subtracted from the verifier's reward when the episode ended without a final answer or
had malformed tool calls; component format_penalty; the task's reward range is widened below
by it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rl360.envs.api import Env, EnvStart, SandboxSpec, TaskRefused, ToolResult
from rl360.envs.sandbox import Sandbox, SandboxLimits
from rl360.envs.sandbox.usernet import usernet_unavailable
from rl360.envs.search_tool import check_tool_names, make_toolbox
from rl360.envs.tools import ToolBox
from rl360.envs.verifier import (
    PREP_TIMEOUT_S,
    SCRATCH_DIRS,
    VerifierError,
    copy_tree,
    parse_reward,
    verify_harbor,
)
from rl360.rewards import FormatPenalty, RewardContext, RewardRange, task_range
from rl360.types import Message, Reward, Task, ToolCall

__all__ = ["SCRATCH_DIRS", "HarborEnv", "VerifierError", "copy_tree", "parse_reward"]
SYSTEM_PROMPT = (
    "You are working in a Linux sandbox; your work dir is {workdir}. Use the tools to inspect "
    "files, run commands and make changes. When the task is done, reply with a short summary "
    "and no tool call."
)


class HarborEnv(Env):
    verify_overhead_s = PREP_TIMEOUT_S + 30.0  # the clean room, then reading the reward

    def __init__(
        self,
        system_prompt: str | None = SYSTEM_PROMPT,
        max_output_chars: int = 8000,
        tools: tuple[str, ...] | None = None,
        format_penalty: float = 0.0,
    ) -> None:
        if format_penalty < 0:
            raise ValueError(f"format_penalty must be >= 0, got {format_penalty}")
        self.system_prompt = system_prompt
        self.max_output_chars = max_output_chars
        self.tool_names = check_tool_names(tools)
        self.format_penalty = FormatPenalty(format_penalty) if format_penalty else None
        self.task: Task | None = None
        self.sandbox: Sandbox | None = None
        self.toolbox: ToolBox | None = None

    def sandbox_spec(self, task: Task, base: SandboxLimits) -> SandboxSpec:
        d = task.data
        if d.get("network_mode") == "allowlist":
            raise TaskRefused(
                f"harbor task {task.id!r} needs allowlist networking, which RL360 cannot enforce"
            )
        limits = SandboxLimits(
            cpu_seconds=max(base.cpu_seconds, math.ceil(d.get("agent_timeout_sec") or 0)),
            memory_mb=int(d.get("memory_mb") or base.memory_mb),
            max_procs=base.max_procs,
            disk_mb=int(d.get("storage_mb") or base.disk_mb),
            tmp_mb=base.tmp_mb,
            output_bytes=base.output_bytes,
            timeout=base.timeout,
            network=d.get("network_mode") == "public",
            cpus=d.get("cpus") or base.cpus,
        )
        workdir = str(d.get("workdir") or "/app")
        if d.get("docker_image") or d.get("has_dockerfile"):
            what = (
                f"image {d['docker_image']!r}"
                if d.get("docker_image")
                else "environment/Dockerfile"
            )
            return SandboxSpec(
                limits=limits,
                workdir=workdir,
                scratch_dirs=SCRATCH_DIRS,
                backends=["docker"],
                image=d.get("docker_image"),
                build=None if d.get("docker_image") else str(Path(d["path"]) / "environment"),
                why=f"harbor task {task.id!r} needs its own container ({what})",
            )
        no_usernet = usernet_unavailable() if limits.network else None
        if no_usernet:
            return SandboxSpec(
                limits=limits,
                workdir=workdir,
                scratch_dirs=SCRATCH_DIRS,
                backends=["docker"],
                why=f"harbor task {task.id!r} needs the public network; bwrap: {no_usernet}",
            )
        return SandboxSpec(
            limits=limits,
            workdir=workdir,
            scratch_dirs=SCRATCH_DIRS,
            backends=["bwrap", "docker"],
            why=f"harbor task {task.id!r} needs private /logs, /tests and {workdir} dirs",
        )

    def _root(self) -> Path:
        assert self.task is not None, "setup() first"
        return Path(self.task.data["path"])

    async def setup(self, task: Task, sandbox: Sandbox) -> EnvStart:
        if sandbox.backend == "process":
            raise TaskRefused(
                f"harbor task {task.id!r} cannot run on the process sandbox (absolute /logs, /tests)"
            )
        self.task, self.sandbox = task, sandbox
        if task.data.get("has_dockerfile") and sandbox.backend != "docker":
            raise TaskRefused(
                f"harbor task {task.id!r} needs its environment/Dockerfile built (docker backend)"
            )
        await copy_tree(sandbox, self._root() / "environment" / "files", sandbox.workdir)
        await sandbox.exec("mkdir -p /logs/verifier /logs/agent", timeout=30)
        self.toolbox = make_toolbox(sandbox, self.tool_names, self.services,
                                    max_output_chars=self.max_output_chars)
        messages = []
        if self.system_prompt:
            messages.append(
                Message(role="system", content=self.system_prompt.format(workdir=sandbox.workdir))
            )
        messages.append(Message(role="user", content=task.prompt))
        return EnvStart(
            messages=messages,
            tools=self.toolbox.specs,
            agent_timeout_s=task.data.get("agent_timeout_sec"),
            verify_timeout_s=task.data.get("verifier_timeout_sec"),
        )

    async def step(self, tool_call: ToolCall) -> ToolResult:
        if self.toolbox is None:
            return await super().step(tool_call)
        return await self.toolbox.call(tool_call)

    async def run_solution(self) -> Any:
        """Run the task's reference solution/solve.sh in the work dir (the oracle agent)."""
        assert self.sandbox is not None and self.task is not None, "setup() first"
        if await copy_tree(self.sandbox, self._root() / "solution", "/solution") == 0:
            raise ValueError(f"harbor task {self.task.id!r} has no solution/")
        limit = float(self.task.data.get("agent_timeout_sec") or 600)
        return await self.sandbox.exec(
            ["bash", "/solution/solve.sh"], timeout=limit, env=self.task.data.get("env")
        )

    def _penalized(self, reward: Reward) -> Reward:
        if self.format_penalty is None:
            return reward
        answer = self.final_answer
        pen = self.format_penalty(RewardContext(
            answer=answer, has_final_answer=answer is not None,
            malformed_tool_calls=self.counter("malformed_tool_calls")))
        reward.value += pen.value
        reward.components["format_penalty"] = pen.value
        return reward

    def reward_range(self, task: Task) -> RewardRange:
        rng = task_range(task)
        return rng.widened(self.format_penalty.penalty) if self.format_penalty else rng

    async def verify(self) -> Reward:
        assert self.sandbox is not None and self.task is not None, "setup() first"
        reward = await verify_harbor(self.sandbox, self.task, self.verify_limit_s)
        return self._penalized(reward)
