"""The session ledger as a forest (docs/TITO.md section 3): truncated replies
continued, n > 1 and concurrent siblings, new roots, branches, caps and pickers. Service-level
(no Ray, scripted engine); every case ends with the full TITO invariant check."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec

from rl360.recipe import EngineSection, ModelSection, ServeSection
from rl360.serve.engines.scripted import ScriptedBackend
from rl360.serve.sessions.openai_types import ApiError, ChatCompletionRequest
from rl360.serve.sessions.service import LocalEngineClient, SessionService
from tests.serve.sessions.tito import BASH, SEARCH, check_engine_fidelity, check_trajectory

RULES = [
    ["summarize", "A short summary."],
    ["think first", "<think>plan: say hi</think>Hello."],
    ["/w\n</tool_response>", "There are 2 files."],
    ["list files", 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls", '
                   '"flags": "-la"}}\n</tool_call>'],
]


def service(**cfg: Any) -> SessionService:
    from rl360.policies.chat import ChatRenderer
    from rl360.policies.loading import load_tokenizer

    renderer = ChatRenderer(load_tokenizer("tiny", "auto"))
    be = ScriptedBackend(EngineSection(options={"rules": RULES, "delay_s": 0.02}), ModelSection(),
                         tokenizer=renderer.tokenizer)
    return SessionService(renderer, LocalEngineClient(be), ServeSection(**cfg),
                          max_model_len=ModelSection().max_model_len, model_name="rl360")


def req(messages: list[dict[str, Any]], tools: Any = BASH, **kw: Any) -> ChatCompletionRequest:
    return msgspec.convert({"messages": messages, "tools": tools, **kw}, ChatCompletionRequest)


class Agent:
    """One session driven like an OpenAI client: keeps every response for the checks."""

    def __init__(self, svc: SessionService) -> None:
        self.svc = svc
        s = svc.open()
        self.sid, self.token = s["id"], s["token"]
        self.responses: list[dict[str, Any]] = []
        self.calls: list[list[int]] = []

    async def chat(self, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
        engine = self.svc.engine.backend  # type: ignore[attr-defined]
        seen = len(engine.calls)
        out = await self.svc.chat(self.sid, self.token, req(messages, **kw))
        assert not isinstance(out, ApiError), out
        self.calls += engine.calls[seen:]  # this session's prompts (agents run one by one)
        self.responses.append(out)
        return out

    def check(self, truncated_closed: bool = False) -> dict[str, Any]:
        traj = self.svc.trajectory(self.sid, self.token)
        snap = check_trajectory(traj, self.responses, truncated_closed)
        check_engine_fidelity(snap, traj["forest"], self.calls)
        return traj


def reply(out: dict[str, Any], i: int = 0) -> dict[str, Any]:
    msg = dict(out["choices"][i]["message"])
    return {k: v for k, v in msg.items() if v is not None}


async def test_truncated_reply_is_continued_with_a_synthetic_end_of_turn() -> None:
    svc = service()
    a = Agent(svc)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
    out = await a.chat(msgs, max_tokens=5)
    assert out["choices"][0]["finish_reason"] == "length"
    msgs += [reply(out), {"role": "user", "content": "summarize please"}]
    out = await a.chat(msgs)
    assert out["choices"][0]["message"]["content"] == "A short summary."
    traj = a.check()
    assert [n["parent"] for n in traj["forest"]] == [None, 0]
    assert traj["counters"]["synthetic_eos"] == 1 and traj["picked"] == [1]
    eot = svc.renderer.end_of_turn_id
    child = traj["forest"][1]
    assert child["tokens"][0] == eot and child["provenance"][0] == "junction"
    assert traj["rerender"].get("special_token_count", 0) == 0
    assert traj["rerender"].get("special_token_type", 0) == 0


async def test_n_choices_are_siblings_and_each_can_be_continued() -> None:
    a = Agent(service())
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    out = await a.chat(msgs, n=2, seed=7)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    first = await a.chat([*msgs, reply(out, 0), {"role": "user", "content": "summarize"}])
    traj = a.check()
    assert [n["parent"] for n in traj["forest"]] == [None, None, 1]  # ties: the latest node
    assert traj["picked"] == [0, 2] and first["choices"][0]["message"]["content"]


async def test_second_conversation_with_other_tools_is_a_new_root() -> None:
    a = Agent(service())
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent"},
                                  {"role": "user", "content": "list files"}]
    out = await a.chat(msgs)
    side = [{"role": "system", "content": "you summarize"}, {"role": "user", "content": "summarize x"}]
    await a.chat(side, tools=SEARCH)  # a sub-call: other system prompt, other tools
    call = reply(out)["tool_calls"][0]
    msgs += [reply(out), {"role": "tool", "tool_call_id": call["id"], "content": "/w"}]
    await a.chat(msgs)  # the main line goes on under its own root
    traj = a.check()
    assert [n["parent"] for n in traj["forest"]] == [None, None, 0]
    assert traj["counters"]["new_root"] == 1 and traj["counters"]["render_config_changed"] == 1
    assert traj["picked"] == [1, 2] and traj["rerender"] == {"match": True}
    assert traj["branches"][0]["rerender"] == {"match": True}


async def test_client_edited_history_matches_or_branches() -> None:
    svc = service()
    a = Agent(svc)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
    out = await a.chat(msgs)
    r = reply(out)
    for tc in r["tool_calls"]:  # re-serialized arguments: other key order and spacing
        args = json.loads(tc["function"]["arguments"])
        tc["function"]["arguments"] = json.dumps(dict(reversed(list(args.items()))),
                                                 separators=(",", ":"))
    msgs += [r, {"role": "tool", "tool_call_id": r["tool_calls"][0]["id"], "content": "/w"}]
    await a.chat(msgs)
    msgs2: list[dict[str, Any]] = [{"role": "user", "content": "think first"}]
    b = Agent(svc)
    out = await b.chat(msgs2)
    assert out["choices"][0]["message"]["content"].startswith("<think>")
    dropped = {"role": "assistant", "content": "Hello."}  # reasoning dropped by the client
    await b.chat([*msgs2, dropped, {"role": "user", "content": "summarize"}])
    for agent in (a, b):  # the loose matcher keeps both lines linear
        traj = agent.check()
        assert len(traj["forest"]) == 2 and traj["forest"][1]["parent"] == 0
        assert "prefix_changed" not in traj["counters"]
    # the strict matcher branches instead: the edited reply becomes client prompt
    strict = Agent(service(matcher="strict"))
    await strict.chat(msgs2)
    await strict.chat([*msgs2, dropped, {"role": "user", "content": "summarize"}])
    traj = strict.check()
    assert [n["parent"] for n in traj["forest"]] == [None, None]
    edited_root = traj["forest"][1]  # the edited reply is prompt there (mask 0)
    assert set(edited_root["provenance"]) == {"prompt", "generated"}
    assert traj["counters"]["prefix_changed"] == 1 and traj["counters"]["new_root"] == 1
    assert len(traj["picked"]) == 2


async def test_deep_rewrite_branches_at_the_deepest_matching_node() -> None:
    a = Agent(service())
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
    out = await a.chat(msgs)
    call = reply(out)["tool_calls"][0]
    msgs += [reply(out), {"role": "tool", "tool_call_id": call["id"], "content": "/w"}]
    out2 = await a.chat(msgs)
    await a.chat([*msgs, reply(out2), {"role": "user", "content": "summarize"}])
    edited = [*msgs[:2], {"role": "tool", "tool_call_id": call["id"], "content": "other"},
              {"role": "user", "content": "summarize"}]
    await a.chat(edited)  # an earlier tool output edited: branch under node 0
    traj = a.check()
    assert [n["parent"] for n in traj["forest"]] == [None, 0, 1, 0]
    assert traj["counters"]["prefix_changed"] == 1
    assert traj["branch_points"] == [{"first_divergent_index": 2, "attached_at": 0, "nodes": [3]}]
    assert traj["picked"] == [2, 3]


async def test_concurrent_first_turns_and_pickers() -> None:
    for picker, want in (("all", [0, 1, 2]), ("last", [2]), ("longest", [2])):
        a = Agent(service(picker=picker))
        r1 = [{"role": "user", "content": "hello"}]
        r2 = [{"role": "user", "content": "list files please, all of them"}]
        await asyncio.gather(a.chat(r1), a.chat(r1))
        await a.chat(r2)
        traj = a.check()
        assert [n["parent"] for n in traj["forest"]] == [None, None, None]
        assert traj["picked"] == want and len(traj["branches"]) == len(want) - 1


async def test_node_and_token_caps_are_clear_4xx_and_change_nothing() -> None:
    svc = service(max_session_nodes=2)
    a = Agent(svc)
    await a.chat([{"role": "user", "content": "hello"}])
    err = await svc.chat(a.sid, a.token, req([{"role": "user", "content": "hello"}], n=2))
    assert isinstance(err, ApiError) and err.status == 409 and "serve.max_session_nodes" in err.message
    assert len(svc.trajectory(a.sid, a.token)["forest"]) == 1
    svc = service(max_session_tokens=50)
    b = Agent(svc)
    err = await svc.chat(b.sid, b.token, req([{"role": "user", "content": "x" * 400}]))
    assert isinstance(err, ApiError) and err.code == "session_token_cap"
    assert "serve.max_session_tokens" in err.message
    assert svc.trajectory(b.sid, b.token)["forest"] == []


async def test_shared_prefixes_are_stored_once() -> None:
    svc = service()
    a = Agent(svc)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    out = await a.chat(msgs)
    msgs += [reply(out), {"role": "user", "content": "summarize"}]
    await a.chat(msgs, n=3)
    led = svc.sessions[a.sid].ledger
    own = sum(len(n["tokens"]) for n in a.check()["forest"])
    delta = sum(len(ids) for ids, _ in led.nodes[1].segments)
    assert led.nodes[1].segments is led.nodes[3].segments  # one delta for the n siblings
    assert led.stored_tokens == own - 2 * delta
