"""CodeEnv: function-level Python tasks, single-turn or with tools.

The model's final answer holds the code: the last ```python block (or the last untagged block,
or an unterminated one), else the bare text when it looks like Python. The tests (assert lines,
or one test-code string) run in the sandbox, each on its own with a per-test time limit: the test
code runs in a parent process that alone holds the report channel, the solution in a fresh child
per test that only exchanges plain data with it (rl360/envs/sandbox/isolated_runner.py). With
tools the grading runs in the episode's own sandbox, after every process the agent left there
is killed (`Sandbox.sweep`).
Reward: the configured reward function (default the fraction of tests passed), plus a format penalty when
`format_penalty` > 0, with components tests_passed, all_pass and format. Every constructor
parameter can be set from the recipe (`env.params`).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from rl360.envs.api import Env, EnvStart, ToolResult
from rl360.envs.sandbox import Sandbox
from rl360.envs.sandbox.runner_input import runner_argv, runner_stdin
from rl360.envs.search_tool import check_tool_names, make_toolbox
from rl360.envs.tools import ToolBox
from rl360.rewards import RewardContext, RewardRange, env_reward, task_range
from rl360.types import Message, Reward, Task, ToolCall

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.S)
_LOOKS_LIKE_PY = re.compile(r"^\s*(def|class|import|from|return|lambda|print|async def)\b", re.M)

# The grader runs inside the sandbox (stdlib only, envs/sandbox/isolated_runner.py): its parent
# reads the spec from stdin and runs each test itself against a fresh child process that holds
# the solution. It starts through runner_input.BOOT, which hands it its code compiled.


def extract_code(text: str | None) -> str | None:
    """The code in a model's answer, or None when there is none."""
    if not text:
        return None
    text = _THINK.sub("", text)
    blocks = _FENCE.findall(text)
    if blocks:
        py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
        plain = [body for lang, body in blocks if not lang]
        chosen = (py or plain or [blocks[-1][1]])[-1]
        return chosen.strip("\n") or None
    if _LOOKS_LIKE_PY.search(text):
        return text.strip("\n")
    return None


def test_units(task: Task) -> list[str]:
    """The task's tests as separately-run code units."""
    tests = task.data.get("tests")
    if isinstance(tests, list):
        return [str(t) for t in tests]
    if isinstance(tests, str) and tests.strip():
        entry = task.data.get("entry_point")
        if entry and re.search(r"^def check\(", tests, re.M):
            return [f"{tests}\ncheck({entry})"]
        return [tests]
    raise ValueError(f"code task {task.id!r} has no tests")


class CodeEnv(Env):
    """Function-level Python tasks. `tools=True` gives the model the built-in tools (and the
    stack's `search` tool when it runs; `tool_names` picks a subset) and a multi-turn episode;
    the final answer still carries the code."""

    def __init__(
        self,
        tools: bool = False,
        system_prompt: str | None = None,
        reward: str = "tests_passed",
        reward_params: dict[str, Any] | None = None,
        format_penalty: float = 0.0,
        per_test_timeout_s: float = 2.0,
        python_flags: tuple[str, ...] = ("-I", "-S"),
        tool_names: tuple[str, ...] | None = None,
    ) -> None:
        self.use_tools = tools
        self.tool_names = check_tool_names(tool_names)
        self.reuse_sandbox = not tools  # grading only: one warm sandbox serves many episodes
        self.system_prompt = system_prompt
        self.reward_fn = env_reward(reward, reward_params, format_penalty)
        self.format_penalty = format_penalty
        self.per_test_timeout_s = per_test_timeout_s
        self.python_flags = list(python_flags)
        self.task: Task | None = None
        self.sandbox: Sandbox | None = None
        self.toolbox: ToolBox | None = None

    def reward_range(self, task: Task) -> RewardRange:
        return task_range(task).widened(self.format_penalty)

    def verify_key(self) -> str | None:
        if self.use_tools or self.task is None:
            return None
        return json.dumps([self.task.id, self.final_answer, self.counter("malformed_tool_calls")])

    async def setup(self, task: Task, sandbox: Sandbox) -> EnvStart:
        test_units(task)  # fail early on a task without tests
        self.task, self.sandbox = task, sandbox
        messages = (
            [Message(role="system", content=self.system_prompt)] if self.system_prompt else []
        )
        messages.append(Message(role="user", content=task.prompt))
        if not self.use_tools:
            return EnvStart(messages=messages)
        self.toolbox = make_toolbox(sandbox, self.tool_names, self.services)
        return EnvStart(messages=messages, tools=self.toolbox.specs)

    async def step(self, tool_call: ToolCall) -> ToolResult:
        if self.toolbox is None:
            return await super().step(tool_call)
        return await self.toolbox.call(tool_call)

    async def run_tests(self, code: str) -> tuple[int, int, list[str]]:
        """(passed, total, per-test notes) for `code` against the task's tests."""
        assert self.task is not None and self.sandbox is not None, "setup() first"
        units = test_units(self.task)
        if self.use_tools:  # the agent ran commands here: nothing it left runs beside the grader
            await self.sandbox.sweep()
        nonce = secrets.token_hex(8)
        stdin = runner_stdin(nonce, self.per_test_timeout_s, code, units,
                             self.task.data.get("entry_point"))
        # per test: a child interpreter start (not counted in the per-test time: the runner
        # allows it up to 30 s on a loaded host), then the solution's load and the test itself
        limit = (self.per_test_timeout_s + 2.0) * (len(units) + 1) + 10.0
        res = await self.sandbox.exec(runner_argv("python3", self.python_flags), timeout=limit,
                                      stdin=stdin)
        passed, notes = 0, []
        seen: set[int] = set()
        for line in res.stdout.splitlines():
            parts = line.split(" ", 3)
            if len(parts) < 3 or parts[0] != nonce or not parts[1].isdigit():
                continue
            i = int(parts[1])
            if i in seen or i >= len(units):
                continue
            seen.add(i)
            passed += parts[2] == "1"
            notes.append(line[len(nonce) + 1 :])
        if res.timed_out:
            notes.append(f"timed out after {limit:g}s")
        return passed, len(units), notes

    async def grade(self, answer: str | None) -> Reward:
        """Grade one answer text (what verify does with the final answer)."""
        assert self.task is not None, "setup() first"
        code = extract_code(answer)
        total = len(test_units(self.task))
        passed, notes = 0, ["no code found in the answer"]
        if code is not None:
            passed, total, notes = await self.run_tests(code)
        ctx = RewardContext(
            answer=answer,
            reference=self.task.data.get("answer"),
            tests_passed=passed,
            tests_total=total,
            malformed_tool_calls=self.counter("malformed_tool_calls"),
            has_final_answer=answer is not None,
            format_ok=code is not None,
            task=self.task,
        )
        reward = self.reward_fn(ctx)
        frac = passed / total if total else 0.0
        components = {
            "tests_passed": frac,
            "all_pass": 1.0 if total and passed == total else 0.0,
            "format": 1.0 if code is not None else 0.0,
            **reward.components,
        }
        return Reward(
            value=reward.value, components=components, info={**reward.info, "tests": notes}
        )

    async def verify(self) -> Reward:
        return await self.grade(self.final_answer)
