"""ToolEnv ("tools"): a generic tool-using task. The model gets tools in the sandbox (default:
the built-in ones plus the stack's `search` tool when it runs; `tools` names them, "search"
included) and ends with a final answer, graded by a reward function (default: exact answer,
normalized, against task.data["answer"]) plus an optional format penalty; optional
task.data["files"] ({path: text}) seed the work dir. A task's data may narrow the tools
(task.data["tools"]). Every constructor parameter can be set from the recipe (`env.params`)."""

from __future__ import annotations

from typing import Any

from rl360.envs.api import Env, EnvStart, ToolResult
from rl360.envs.sandbox import Sandbox
from rl360.envs.search_tool import check_tool_names, make_toolbox
from rl360.envs.tools import ToolBox
from rl360.rewards import RewardContext, RewardRange, env_reward, task_range
from rl360.types import Message, Reward, Task, ToolCall


class ToolEnv(Env):
    def __init__(
        self,
        system_prompt: str | None = None,
        tools: tuple[str, ...] | None = None,
        reward: str = "exact_answer",
        reward_params: dict[str, Any] | None = None,
        format_penalty: float = 0.0,
    ) -> None:
        self.system_prompt = system_prompt
        self.tool_names = check_tool_names(tools)
        self.reward_fn = env_reward(reward, reward_params, format_penalty)
        self.format_penalty = format_penalty
        self.task: Task | None = None
        self.toolbox: ToolBox | None = None

    def reward_range(self, task: Task) -> RewardRange:
        return task_range(task).widened(self.format_penalty)

    async def setup(self, task: Task, sandbox: Sandbox) -> EnvStart:
        self.task = task
        for path, text in (task.data.get("files") or {}).items():
            await sandbox.write_file(str(path), str(text))
        names = task.data.get("tools", self.tool_names)
        self.toolbox = make_toolbox(sandbox, None if names is None else tuple(names),
                                    self.services)
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
