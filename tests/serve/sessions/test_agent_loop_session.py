"""The env actor's side of a session forest: the built-in agent loop, talking to a session
through ShardChatClient, still yields one linear sample (no branches), while an agent that
branches (n=2, a sub-call with other tools) hands every picked leaf to the trainer."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from rl360.actors.buffer import to_samples
from rl360.actors.session_client import FirstTurns, ShardChatClient
from rl360.envs.agent import run_episode
from rl360.envs.api import Env, EnvStart, ToolResult
from rl360.recipe import EngineSection, ModelSection, ServeSection
from rl360.serve.engines.scripted import ScriptedBackend
from rl360.serve.sessions.ledger import LedgerError
from rl360.serve.sessions.openai_types import ChatCompletionRequest
from rl360.serve.sessions.service import LocalEngineClient, SessionService
from rl360.types import Message, Reward, Task, ToolSpec, Trajectory
from tests.envs.test_env_agent import MemorySandbox
from tests.serve.sessions.tito import check_trajectory

TOOLS = [msgspec.convert({"function": {"name": "bash", "parameters": {"type": "object"}}}, ToolSpec)]
RULES = [
    ["</tool_response>", "42"],
    ["do it", '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'],
    ["summarize", "short."],
]


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    async def remote(self, *args: Any) -> Any:
        return await self.fn(*args)


class LocalShard:
    """The SessionShard's chat method over an in-process service (no Ray)."""

    def __init__(self, svc: SessionService) -> None:
        self.chat = _Method(svc.chat)


class OneToolEnv(Env):
    async def setup(self, task: Task, sandbox: Any) -> EnvStart:
        return EnvStart(messages=[Message(role="user", content=task.prompt)], tools=TOOLS)

    async def step(self, call: Any) -> ToolResult:
        return ToolResult(content="a.txt", ok=True)

    async def verify(self) -> Reward:
        return Reward(1.0 if self.transcript[-1].content == "42" else 0.0)


class CountingEngine(LocalEngineClient):
    """The in-process engine client, counting requests (`generate_many`: one per call)."""

    def __init__(self, backend: Any) -> None:
        super().__init__(backend)
        self.requests: list[tuple[str, int]] = []  # (method, generations)

    async def generate(self, prompt_ids: list[int], sampling: Any, route_key: Any) -> Any:
        self.requests.append(("generate", 1))
        return await self.backend.generate(prompt_ids, sampling)

    async def generate_many(self, items: list[Any], route_key: Any) -> list[Any]:
        self.requests.append(("generate_many", len(items)))
        return [await self.backend.generate(ids, sp) for ids, sp in items]


def service(**cfg: Any) -> SessionService:
    from rl360.policies.chat import ChatRenderer
    from rl360.policies.loading import load_tokenizer

    r = ChatRenderer(load_tokenizer("tiny", "auto"))
    be = ScriptedBackend(EngineSection(options={"rules": RULES}), ModelSection(), tokenizer=r.tokenizer)
    return SessionService(r, CountingEngine(be), ServeSection(**cfg),
                          max_model_len=ModelSection().max_model_len, model_name="rl360")


async def test_built_in_agent_loop_is_one_linear_sample() -> None:
    svc = service()
    s = svc.open({"task_id": "t1"})
    client = ShardChatClient(LocalShard(svc), s["id"], s["token"], {"temperature": 1.0})
    result = await run_episode(OneToolEnv(), Task(id="t1", prompt="do it"), MemorySandbox(), client)
    assert result.status == "ok" and result.reward is not None and result.reward.value == 1.0
    full = svc.trajectory(s["id"], s["token"])
    check_trajectory(full, truncated_closed=True)
    assert [n["parent"] for n in full["forest"]] == [None, 0] and full["branches"] == []
    traj = msgspec.convert(svc.close(s["id"], s["token"], forest=False), Trajectory)
    assert traj.branches == [] and traj.turns == 2 and traj.rerender == {"match": True}
    assert traj.tokens == full["tokens"]
    traj.reward = result.reward
    assert len(to_samples([traj], [1.0])) == 1


async def test_a_branching_agent_hands_every_picked_leaf_to_the_trainer() -> None:
    svc = service()
    s = svc.open()

    def req(msgs: list[dict[str, Any]], **kw: Any) -> ChatCompletionRequest:
        return msgspec.convert({"messages": msgs, **kw}, ChatCompletionRequest)

    await svc.chat(s["id"], s["token"], req([{"role": "user", "content": "do it"}], n=2))
    await svc.chat(s["id"], s["token"], req([{"role": "system", "content": "other"},
                                              {"role": "user", "content": "summarize"}]))
    traj = msgspec.convert(svc.close(s["id"], s["token"], forest=False), Trajectory)
    assert len(traj.branches) == 2
    traj.reward = Reward(1.0)
    samples = to_samples([traj], [0.5])
    assert len(samples) == 3 and {x.advantage for x in samples} == {0.5}
    assert all(sum(x.mask) > 0 for x in samples)


class CountingShard:
    """A SessionShard over an in-process service (no Ray) that counts its calls."""

    def __init__(self, svc: SessionService) -> None:
        from collections import Counter

        from rl360.serve.sessions.shard import SessionShard

        shard = SessionShard.over(svc)
        self.calls: Counter[str] = Counter()
        for name in ("open", "chat", "turn", "turns", "close"):
            setattr(self, name, _Method(self._counted(name, getattr(shard, name))))

    def _counted(self, name: str, fn: Any) -> Any:
        async def call(*args: Any) -> Any:
            self.calls[name] += 1
            return await fn(*args)
        return call


async def test_the_loop_opens_and_closes_its_session_inside_its_turns() -> None:
    """One shard call per turn: the first opens the session (with the caller's token), the
    final one (no tool calls) closes it and hands back the samples the close would give."""
    svc = service()
    shard = CountingShard(svc)
    token = "t" * 24
    client = ShardChatClient(shard, "s1", token, {"temperature": 1.0},
                             open_meta={"task_id": "t1"}, close_final=True)
    result = await run_episode(OneToolEnv(), Task(id="t1", prompt="do it"), MemorySandbox(), client)
    assert result.status == "ok" and result.reward is not None and result.reward.value == 1.0
    assert dict(shard.calls) == {"turn": 2}
    assert svc.sessions == {} and client.closed is not None
    traj = msgspec.convert(client.closed, Trajectory)
    assert traj.turns == 2 and traj.task_id == "t1" and traj.rerender == {"match": True}
    traj.reward = result.reward
    assert traj.branches == [] and len(to_samples([traj], [1.0])) == 1


async def test_a_turn_that_cannot_open_says_why_and_runs_no_chat() -> None:
    svc = service()
    shard = CountingShard(svc)
    svc.open({}, None, "s1")  # the id is taken
    client = ShardChatClient(shard, "s1", "t" * 24, {}, open_meta={}, close_final=True)
    result = await run_episode(OneToolEnv(), Task(id="t1", prompt="do it"), MemorySandbox(), client)
    assert result.status == "infra_error" and "could not open a session" in result.reason
    assert "session_exists" in result.reason and svc.events["chat_completions"] == 0
    with pytest.raises(LedgerError, match="at least 16"):
        svc.open({}, None, "s2", token="short")


async def test_a_groups_first_turns_go_in_one_shard_call_and_one_engine_request() -> None:
    """FirstTurns: the first turns of a group's 4 episodes (which open their sessions) go
    to the shard in one `turns` call and to the engine in one request; each episode keeps
    its own session, ledger and outcome, and the later turns go one by one."""
    import asyncio

    svc = service()
    shard = CountingShard(svc)
    batch = FirstTurns(4, wait_s=30.0)  # all four arrive: no waiting on the timer
    clients = [ShardChatClient(shard, f"s{i}", "t" * 24, {"temperature": 1.0},
                               open_meta={"task_id": "t1", "group_id": "g1"}, close_final=True,
                               first_turns=batch) for i in range(4)]
    results = await asyncio.wait_for(asyncio.gather(*(
        run_episode(OneToolEnv(), Task(id="t1", prompt="do it"), MemorySandbox(), c)
        for c in clients)), 10)
    assert all(r.status == "ok" and r.reward is not None and r.reward.value == 1.0
               for r in results)
    assert dict(shard.calls) == {"turns": 1, "turn": 4}  # the second turns: one each
    engine = svc.engine
    assert isinstance(engine, CountingEngine)
    assert engine.requests.count(("generate_many", 4)) == 1
    assert sorted(engine.requests) == [("generate", 1)] * 4 + [("generate_many", 4)]
    assert svc.sessions == {}
    trajs = [msgspec.convert(c.closed, Trajectory) for c in clients]
    assert {t.session_id for t in trajs} == {"s0", "s1", "s2", "s3"}
    for t in trajs:
        assert t.turns == 2 and t.group_id == "g1" and t.rerender == {"match": True}
        assert len(t.tokens) == len(t.mask) == len(t.logprobs) and sum(t.mask) > 0
    assert len({tuple(t.tokens) for t in trajs}) == 1  # same prompt, same scripted replies


async def test_first_turns_go_without_a_member_that_left_or_was_refused() -> None:
    """A member that ends before its first turn (`leave`) does not hold the batch back; a
    member the shard refuses (its session id is taken) fails alone, saying why."""
    import asyncio

    svc = service()
    shard = CountingShard(svc)
    svc.open({}, None, "taken")
    batch = FirstTurns(3, wait_s=30.0)
    clients = [ShardChatClient(shard, sid, "t" * 24, {}, open_meta={}, close_final=True,
                               first_turns=batch) for sid in ("ok", "taken")]

    async def leaves() -> None:
        await asyncio.sleep(0.05)
        batch.leave()

    ok, refused, _ = await asyncio.wait_for(asyncio.gather(*(
        run_episode(OneToolEnv(), Task(id="t1", prompt="do it"), MemorySandbox(), c)
        for c in clients), leaves()), 10)
    assert ok.status == "ok"
    assert refused.status == "infra_error" and "session_exists" in refused.reason
    assert shard.calls["turns"] == 1


async def test_a_member_cancelled_before_its_batch_goes_is_left_out() -> None:
    import asyncio

    svc = service()
    shard = CountingShard(svc)
    batch = FirstTurns(2, wait_s=30.0)
    a, b = (ShardChatClient(shard, sid, "t" * 24, {}, open_meta={}, close_final=True,
                            first_turns=batch) for sid in ("a", "b"))
    msgs = [Message(role="user", content="summarize")]
    first = asyncio.ensure_future(a.chat(msgs, []))
    await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    turn = await asyncio.wait_for(b.chat(msgs, []), 10)
    assert turn.message.content == "short." and b.closed is not None
    assert shard.calls["turns"] == 1 and "a" not in svc.sessions  # a was never opened
