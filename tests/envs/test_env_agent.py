"""The built-in agent loop with a scripted ChatClient and an in-memory env/sandbox."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from rl360.envs.agent import (
    ChatTurn,
    InfraError,
    ScriptedClient,
    run_agent_fn,
    run_episode,
)
from rl360.envs.api import Env, EnvStart, ToolResult
from rl360.envs.sandbox import ExecResult, Sandbox, SandboxStartError
from rl360.recipe import EnvSection, checked
from rl360.types import FunctionCall, Message, Reward, Task, ToolCall

pytestmark = pytest.mark.timeout(30)
TASK = Task(id="t1", prompt="do it")


class MemorySandbox(Sandbox):
    """A do-nothing sandbox for loop tests (fail_start: start raises)."""

    backend = "memory"

    def __init__(self, fail_start: bool = False) -> None:
        super().__init__()
        self.fail_start = fail_start

    async def start(self) -> None:
        if self.fail_start:
            raise SandboxStartError("bwrap: cannot create namespace")

    async def exec(self, cmd, timeout=None, cwd=None, env=None):  # noqa: ASYNC109
        return ExecResult("", "", 0)

    async def write_file(self, path, data, mode=None) -> None:
        return None

    async def read_file(self, path, max_bytes=None) -> bytes:
        return b""

    async def close(self) -> None:
        return None


class EchoEnv(Env):
    """Tool "ok" succeeds, "fail" fails, "boom" raises, "slow" sleeps; verify scores the
    final answer "42" as 1."""

    def __init__(self, verify_raises: bool = False, setup_raises: bool = False) -> None:
        self.verify_raises = verify_raises
        self.setup_raises = setup_raises
        self.steps: list[str] = []

    async def setup(self, task: Task, sandbox: Sandbox) -> EnvStart:
        if self.setup_raises:
            raise RuntimeError("task data broken")
        return EnvStart(messages=[Message(role="user", content=task.prompt)], tools=[])

    async def step(self, tool_call: ToolCall) -> ToolResult:
        name = tool_call.function.name
        self.steps.append(name)
        if name == "boom":
            raise InfraError("sandbox helper died")
        if name == "slow":
            await asyncio.sleep(5)
        if name == "big":
            return ToolResult("x" * 50_000)
        return ToolResult(f"ran {name}", ok=name != "fail")

    async def verify(self) -> Reward:
        if self.verify_raises:
            raise RuntimeError("test.sh crashed")
        answer = self.final_answer
        return Reward(
            value=1.0 if answer == "42" else 0.0,
            components={"malformed": float(self.counter("malformed_tool_calls"))},
        )


def call(name: str, i: int = 0) -> ToolCall:
    return ToolCall(id=f"call_{name}_{i}", function=FunctionCall(name=name, arguments="{}"))


def tools_msg(*names: str) -> Message:
    return Message(
        role="assistant", content=None, tool_calls=[call(n, i) for i, n in enumerate(names)]
    )


def answer(text: str) -> Message:
    return Message(role="assistant", content=text)


async def episode(script: Sequence[object], env: Env | None = None,
                  verify_cache: dict[str, object] | None = None, **cfg: object):
    env = env or EchoEnv()
    client = ScriptedClient(script)
    result = await run_episode(env, TASK, MemorySandbox(), client, EnvSection(**cfg),  # type: ignore[arg-type]
                               verify_cache=verify_cache)  # type: ignore[arg-type]
    return result, client, env


async def test_final_answer_ends_episode():
    res, client, _ = await episode([answer("42")])
    assert (res.status, res.turns, res.reward.value) == ("ok", 1, 1.0)
    assert res.messages[-1].content == "42" and len(client.calls) == 1
    assert set(res.timings) >= {"setup_s", "rollout_s", "verify_s", "total_s"}


async def test_episode_times_its_phases_and_sums_the_servers():
    """The per-phase timers the step breakdown reads: sandbox start, chat and tool time, and
    the server-side shares a chat turn reports (summed over turns)."""
    turn = ChatTurn(message=Message(role="assistant", content="42"),
                    timings={"server_engine_s": 0.25, "server_render_s": 0.5})
    tools_turn = ChatTurn(message=tools_msg("ok"), finish_reason="tool_calls",
                          timings={"server_engine_s": 1.0})
    res, _, _ = await episode([tools_turn, turn])
    assert res.status == "ok" and res.turns == 2
    assert res.timings["server_engine_s"] == 1.25 and res.timings["server_render_s"] == 0.5
    assert {"sandbox_start_s", "chat_s", "tools_s"} <= set(res.timings)
    assert res.timings["chat_s"] <= res.timings["rollout_s"]


async def test_tool_calls_then_answer():
    res, client, env = await episode([tools_msg("ok", "ok"), answer("42")])
    assert res.status == "ok" and res.reward.value == 1.0 and env.steps == ["ok", "ok"]
    tool_msgs = [m for m in res.messages if m.role == "tool"]
    assert [m.tool_call_id for m in tool_msgs] == ["call_ok_0", "call_ok_1"]
    assert client.calls[1][-1].content == "ran ok"  # the model saw the tool result
    assert res.counters["tool_calls"] == 2 and res.counters["tool_failures"] == 0


async def test_max_turns_is_truncated_and_still_verified():
    res, _, _ = await episode([tools_msg("ok")] * 3, max_turns=3)
    assert res.status == "truncated" and "max_turns" in res.reason and res.reward is not None


async def test_answer_cut_at_token_limit_is_truncated():
    res, _, _ = await episode([ChatTurn(message=answer("4"), finish_reason="length")])
    assert res.status == "truncated" and res.reward.value == 0.0


async def test_consecutive_tool_failures_end_episode():
    res, _, env = await episode(
        [tools_msg("fail"), tools_msg("fail"), tools_msg("fail"), answer("42")]
    )
    assert res.status == "error" and "3 consecutive" in res.reason
    assert res.reward is not None and res.reward.value == 0.0  # the model's fault: scored
    assert env.steps == ["fail"] * 3 and res.counters["tool_failures"] == 3


async def test_success_resets_failure_count():
    script = [tools_msg("fail", "fail"), tools_msg("ok"), tools_msg("fail", "fail"), answer("42")]
    res, _, _ = await episode(script)
    assert res.status == "ok" and res.reward.value == 1.0


async def test_malformed_tool_calls_are_counted():
    turns = [
        ChatTurn(message=tools_msg("ok"), finish_reason="tool_calls", malformed_tool_calls=1),
        ChatTurn(message=answer("<tool_call>{bad json</tool_call>"), malformed_tool_calls=1),
    ]
    res, _, _ = await episode(turns)
    assert res.status == "ok" and res.counters["malformed_tool_calls"] == 2
    assert res.reward.components["malformed"] == 2.0


async def test_client_connection_error_is_infra_error():
    res, _, _ = await episode([tools_msg("ok"), ConnectionRefusedError("engine unreachable")])
    assert res.status == "infra_error" and res.reward is None
    assert "ConnectionRefusedError" in res.reason and res.turns == 1


async def test_hung_client_is_infra_error():
    client = ScriptedClient([answer("42")], delay_s=5)
    res = await run_episode(
        EchoEnv(), TASK, MemorySandbox(), client, EnvSection(call_timeout_s=0.2)
    )
    assert res.status == "infra_error" and "chat call exceeded" in res.reason and res.reward is None


async def test_episode_timeout_is_timeout_and_verified():
    client = ScriptedClient([tools_msg("ok")] * 10, delay_s=0.15)
    cfg = EnvSection(episode_timeout_s=0.4, call_timeout_s=5, max_turns=10)
    res = await run_episode(EchoEnv(), TASK, MemorySandbox(), client, cfg)
    assert res.status == "timeout" and res.reward is not None


async def test_slow_tool_hits_episode_timeout():
    res, _, _ = await episode([tools_msg("slow"), answer("42")], episode_timeout_s=0.3)
    assert res.status == "timeout" and res.reward is not None


async def test_env_agent_timeout_from_setup_is_honoured():
    class ShortEnv(EchoEnv):
        async def setup(self, task: Task, sandbox: Sandbox) -> EnvStart:
            start = await super().setup(task, sandbox)
            start.agent_timeout_s = 0.3
            return start

    res, _, _ = await episode([tools_msg("slow"), answer("42")], env=ShortEnv())
    assert res.status == "timeout" and "0.3" in res.reason


async def test_infra_failures_are_never_scored():
    res, _, _ = await episode([answer("42")], env=EchoEnv(verify_raises=True))
    assert res.status == "infra_error" and "test.sh crashed" in res.reason and res.reward is None
    res, _, _ = await episode([answer("42")], env=EchoEnv(setup_raises=True))
    assert res.status == "infra_error" and "task data broken" in res.reason
    res, _, _ = await episode([tools_msg("boom"), answer("42")])
    assert res.status == "infra_error" and "sandbox helper died" in res.reason
    client = ScriptedClient([answer("42")])
    res = await run_episode(EchoEnv(), TASK, MemorySandbox(fail_start=True), client)
    assert res.status == "infra_error" and "cannot create namespace" in res.reason
    assert client.calls == []


async def test_tool_output_is_clipped():
    res, _, _ = await episode([tools_msg("big"), answer("42")], max_tool_output_chars=1000)
    tool = next(m for m in res.messages if m.role == "tool")
    assert len(tool.content) < 1100 and "characters dropped" in tool.content


async def test_agent_function_form():
    async def good(task: Task, client: object, sandbox: Sandbox) -> Reward:
        return Reward(value=0.5, components={"x": 1.0})

    async def broken(task: Task, client: object, sandbox: Sandbox) -> Reward:
        raise ConnectionError("openai endpoint down")

    async def slow(task: Task, client: object, sandbox: Sandbox) -> Reward:
        await asyncio.sleep(5)
        return Reward(value=1.0)

    ok = await run_agent_fn(good, TASK, object(), MemorySandbox())
    assert ok.status == "ok" and ok.reward.value == 0.5
    bad = await run_agent_fn(broken, TASK, object(), MemorySandbox())
    assert bad.status == "infra_error" and bad.reward is None and "endpoint down" in bad.reason
    late = await run_agent_fn(
        slow, TASK, object(), MemorySandbox(), EnvSection(episode_timeout_s=0.2)
    )
    assert late.status == "timeout" and late.reward is None
    nostart = await run_agent_fn(good, TASK, object(), MemorySandbox(fail_start=True))
    assert nostart.status == "infra_error"


def test_agent_config_validation():
    with pytest.raises(ValueError, match="max_turns"):
        checked(EnvSection, max_turns=0)
    with pytest.raises(ValueError, match="call_timeout_s"):
        checked(EnvSection, call_timeout_s=0)


class CountingEnv(EchoEnv):
    """EchoEnv with a verify key (the final answer) and a slow, counted verify."""

    graded: list[str] = []

    def __init__(self, verify_raises: bool = False) -> None:
        super().__init__(verify_raises=verify_raises)

    def verify_key(self) -> str | None:
        return f"{TASK.id}:{self.final_answer}"

    async def verify(self) -> Reward:
        CountingEnv.graded.append(self.final_answer or "")
        await asyncio.sleep(0.05)  # the others arrive while this grading runs
        return await super().verify()


async def test_identical_concurrent_answers_are_graded_once():
    """A group's members often answer identically: one sandboxed grading serves every
    concurrent episode with the same submission; a different answer is graded on its own."""
    CountingEnv.graded = []
    cache: dict[str, object] = {}
    texts = ["42", "42", "41", "42"]
    results = await asyncio.gather(*(
        run_episode(CountingEnv(), TASK, MemorySandbox(), ScriptedClient([answer(t)]),
                    EnvSection(), verify_cache=cache)  # type: ignore[arg-type]
        for t in texts))
    assert sorted(CountingEnv.graded) == ["41", "42"]
    assert [r.reward.value for r in results] == [1.0, 1.0, 0.0, 1.0]
    assert sum(r.counters.get("verify_cached", 0) for r in results) == 2
    later, _, _ = await episode([answer("42")], env=CountingEnv(), verify_cache=cache)
    assert later.reward.value == 1.0 and later.counters["verify_cached"] == 1
    assert len(CountingEnv.graded) == 2


async def test_a_failed_shared_grading_leaves_the_others_to_grade_alone():
    CountingEnv.graded = []
    cache: dict[str, object] = {}
    failing = run_episode(CountingEnv(verify_raises=True), TASK, MemorySandbox(),
                          ScriptedClient([answer("42")]), EnvSection(), verify_cache=cache)
    fine = run_episode(CountingEnv(), TASK, MemorySandbox(), ScriptedClient([answer("42")]),
                       EnvSection(), verify_cache=cache)
    bad, good = await asyncio.gather(failing, fine)
    assert bad.status == "infra_error" and good.status == "ok" and good.reward.value == 1.0
    assert "verify_cached" not in good.counters and CountingEnv.graded == ["42", "42"]
    assert not [v for v in cache.values() if not isinstance(v, Reward)]  # no future left
