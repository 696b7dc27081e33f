"""Compatibility with the real `openai` client against a running session server (Serve,
scripted engine): the moves real agents make, each answered 200 with a ledger that passes
every TITO invariant (tests/serve/sessions/tito.py), re-render divergences counted."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.serve.sessions.tito import BASH, SEARCH, check_trajectory
from tests.serving import open_session, serving

pytestmark = pytest.mark.ray

RULES = [
    ["summarize", "A short summary."],
    ["</tool_response>", "Found a.txt."],
    ["list files", 'Looking.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls", '
                   '"all": true}}\n</tool_call>'],
    ["think first", "<think>plan: greet</think>Hello."],
]


@pytest.fixture(scope="module")
def app(ray_cluster):  # type: ignore[no-untyped-def]
    with serving(["engine.backend='scripted'", "serve.session_shards=2"],
                 {"rules": RULES, "delay_s": 0.2}) as h:
        yield h


class Agent:
    def __init__(self, app: Any) -> None:
        from openai import OpenAI

        self.base = app.base_url
        self.sid, self.token = open_session(app.base_url)
        self.client = OpenAI(base_url=f"{app.base_url}/sessions/{self.sid}/v1",
                             api_key=self.token, max_retries=0, timeout=60)
        self.responses: list[dict[str, Any]] = []

    def chat(self, messages: list[dict[str, Any]], **kw: Any) -> Any:
        r = self.client.chat.completions.create(model="x", messages=messages, **kw)  # type: ignore[arg-type]
        self.responses.append(r.model_dump())
        return r

    def check(self) -> dict[str, Any]:
        traj = httpx.get(f"{self.base}/sessions/{self.sid}/trajectory", timeout=30,
                         headers={"Authorization": f"Bearer {self.token}"}).json()
        check_trajectory(traj, self.responses)
        for s in [traj, *traj["branches"]]:  # counted, per picked sample
            assert "match" in s["rerender"]
            assert s["rerender"].get("special_token_type", 0) == 0
        return traj


def as_msg(r: Any, i: int = 0) -> dict[str, Any]:
    return r.choices[i].message.model_dump(exclude_none=True)


def test_multi_turn_with_tools(app) -> None:  # type: ignore[no-untyped-def]
    a = Agent(app)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "agent"},
                                  {"role": "user", "content": "list files"}]
    r = a.chat(msgs, tools=BASH)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    msgs += [as_msg(r), {"role": "tool", "tool_call_id": call.id, "content": "a.txt"}]
    r = a.chat(msgs, tools=BASH)
    msgs += [as_msg(r), {"role": "user", "content": "summarize"}]
    r = a.chat(msgs, tools=BASH)
    assert r.choices[0].message.content == "A short summary."
    traj = a.check()
    assert [n["parent"] for n in traj["forest"]] == [None, 0, 1]
    assert traj["rerender"] == {"match": True} and traj["turns"] == 3


def test_truncated_reply_then_a_new_turn(app) -> None:  # type: ignore[no-untyped-def]
    a = Agent(app)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
    r = a.chat(msgs, tools=BASH, max_tokens=4)
    assert r.choices[0].finish_reason == "length"
    msgs += [as_msg(r), {"role": "user", "content": "summarize what you have"}]
    r = a.chat(msgs, tools=BASH)
    assert r.choices[0].message.content == "A short summary."
    traj = a.check()
    assert [n["parent"] for n in traj["forest"]] == [None, 0]
    assert traj["counters"]["synthetic_eos"] == 1


def test_a_second_conversation_with_other_tools(app) -> None:  # type: ignore[no-untyped-def]
    a = Agent(app)
    main: list[dict[str, Any]] = [{"role": "system", "content": "agent"},
                                  {"role": "user", "content": "list files"}]
    r = a.chat(main, tools=BASH)
    a.chat([{"role": "system", "content": "you summarize"},
            {"role": "user", "content": "summarize this"}], tools=SEARCH)
    call = r.choices[0].message.tool_calls[0]
    main += [as_msg(r), {"role": "tool", "tool_call_id": call.id, "content": "a.txt"}]
    assert a.chat(main, tools=BASH).choices[0].message.content == "Found a.txt."
    traj = a.check()
    assert [n["parent"] for n in traj["forest"]] == [None, None, 0]
    assert sorted(traj["picked"]) == [1, 2] and traj["counters"]["new_root"] == 1


def test_n_equals_two(app) -> None:  # type: ignore[no-untyped-def]
    a = Agent(app)
    r = a.chat([{"role": "user", "content": "hello"}], n=2)
    assert [c.index for c in r.choices] == [0, 1]
    traj = a.check()
    assert [(n["parent"], n["choice"]) for n in traj["forest"]] == [(None, 0), (None, 1)]
    assert traj["picked"] == [0, 1]


def test_two_concurrent_requests(app) -> None:  # type: ignore[no-untyped-def]
    a = Agent(app)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    r = a.chat(msgs)
    msgs += [as_msg(r), {"role": "user", "content": "summarize"}]
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: a.chat(msgs), range(2)))
    assert all(o.choices[0].message.content == "A short summary." for o in outs)
    traj = a.check()
    assert [n["parent"] for n in traj["forest"]] == [None, 0, 0]


def test_client_edited_history(app) -> None:  # type: ignore[no-untyped-def]
    a = Agent(app)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "think first"}]
    r = a.chat(msgs, tools=BASH)
    assert r.choices[0].message.content.startswith("<think>")
    msgs += [{"role": "assistant", "content": "Hello."},  # the reasoning dropped
             {"role": "user", "content": "list files"}]
    r = a.chat(msgs, tools=BASH)
    reply = as_msg(r)
    for tc in reply["tool_calls"]:  # arguments re-serialized: compact, keys reordered
        args = json.loads(tc["function"]["arguments"])
        tc["function"]["arguments"] = json.dumps(dict(sorted(args.items(), reverse=True)),
                                                 separators=(",", ":"))
    msgs += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"],
                     "content": "a.txt"}]
    assert a.chat(msgs, tools=BASH).choices[0].message.content == "Found a.txt."
    traj = a.check()
    assert [n["parent"] for n in traj["forest"]] == [None, 0, 1]  # one line, matched
    assert "prefix_changed" not in traj["counters"]
    # the stored messages and generated tokens stay authoritative (reasoning included)
    assert traj["rerender"] == {"match": True}
