"""ToolEnv ("tools"): a generic tool-using task. The model gets the built-in tools in the
sandbox and ends with a final answer, graded by a reward function (default: exact answer
against task.data["answer"]); optional task.data["files"] ({path: text}) seed the work dir."""

from __future__ import annotations

from typing import Any

from rl360.envs.api import Env, EnvStart, ToolResult
from rl360.envs.sandbox import Sandbox
from rl360.envs.tools import ToolBox
from rl360.rewards import RewardContext, build_reward
from rl360.types import Message, Reward, Task, ToolCall


class ToolEnv(Env):
    def __init__(
        self,
        system_prompt: str | None = None,
        tools: tuple[str, ...] = ("bash", "python", "read_file", "write_file", "edit_file"),
        reward: str = "exact_answer",
        reward_params: dict[str, Any] | None = None,
    ) -> None:
        self.system_prompt = system_prompt
        self.tool_names = tools
        self.reward_fn = build_reward(reward, **(reward_params or {}))
        self.task: Task | None = None
        self.toolbox: ToolBox | None = None

    async def setup(self, task: Task, sandbox: Sandbox) -> EnvStart:
        self.task = task
        for path, text in (task.data.get("files") or {}).items():
            await sandbox.write_file(str(path), str(text))
        self.toolbox = ToolBox(sandbox, self.tool_names)
        messages = (
            [Message(role="system", content=self.system_prompt)] if self.system_prompt else []
        )
        messages.append(Message(role="user", content=task.prompt))
        return EnvStart(messages=messages, tools=self.toolbox.specs)

    async def step(self, tool_call: ToolCall) -> ToolResult:
        assert self.toolbox is not None, "setup() first"
        return await self.toolbox.call(tool_call)

    async def verify(self) -> Reward:
        assert self.task is not None, "setup() first"
        answer = self.final_answer
        return self.reward_fn(
            RewardContext(
                answer=answer,
                reference=self.task.data.get("answer"),
                malformed_tool_calls=self.counter("malformed_tool_calls"),
                has_final_answer=answer is not None,
                task=self.task,
            )
        )
