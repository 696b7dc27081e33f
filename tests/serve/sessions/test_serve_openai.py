"""The session server over real HTTP, driven by the real `openai` client (scripted engine,
so tool calls are deterministic): chat, tool calls, streaming, errors."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serving import open_session, serving

pytestmark = pytest.mark.ray

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
RULES = [
    ["</tool_response>", "Found a.txt."],
    ["list files", 'Looking.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'],
]


@pytest.fixture(scope="module")
def app(ray_cluster):  # type: ignore[no-untyped-def]
    with serving(["engine.backend='scripted'", "serve.session_shards=2"], {"rules": RULES}) as h:
        yield h


def client(app, sid: str, token: str):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    return OpenAI(base_url=f"{app.base_url}/sessions/{sid}/v1", api_key=token, max_retries=0)


def run_agent(app, stream: bool) -> tuple[str, str, list[dict]]:  # type: ignore[no-untyped-def]
    sid, token = open_session(app.base_url)
    c = client(app, sid, token)
    msgs: list[dict] = [{"role": "user", "content": "list files"}]
    if stream:
        chunks = list(c.chat.completions.create(model="x", messages=msgs, tools=TOOLS, stream=True))
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        assert finish == "tool_calls" and len(calls) == 1
        reply = {"role": "assistant", "content": content or None, "tool_calls": [
            {"id": calls[0].id, "type": "function",
             "function": {"name": calls[0].function.name, "arguments": calls[0].function.arguments}}]}
    else:
        r = c.chat.completions.create(model="x", messages=msgs, tools=TOOLS)
        assert r.choices[0].finish_reason == "tool_calls"
        reply = r.choices[0].message.model_dump(exclude_none=True)
    call = reply["tool_calls"][0]
    assert call["function"]["name"] == "bash" and json.loads(call["function"]["arguments"]) == {"cmd": "ls"}
    msgs += [reply, {"role": "tool", "tool_call_id": call["id"], "content": "a.txt"}]
    r2 = c.chat.completions.create(model="x", messages=msgs, tools=TOOLS)
    assert r2.choices[0].message.content == "Found a.txt."
    return sid, token, msgs


def test_openai_client_tool_conversation_and_trajectory(app) -> None:  # type: ignore[no-untyped-def]
    sid, token, _ = run_agent(app, stream=False)
    traj = httpx.get(f"{app.base_url}/sessions/{sid}/trajectory",
                     headers={"Authorization": f"Bearer {token}"}).json()
    assert traj["rerender"] == {"match": True} and traj["turns"] == 2
    assert traj["task_id"] == "t1"
    assert sum(traj["mask"]) == sum(1 for p in traj["provenance"] if p == "generated") > 0
    closed = httpx.delete(f"{app.base_url}/sessions/{sid}", headers={"Authorization": f"Bearer {token}"})
    assert closed.status_code == 200 and closed.json()["tokens"] == traj["tokens"]
    assert httpx.get(f"{app.base_url}/sessions/{sid}/trajectory",
                     headers={"Authorization": f"Bearer {token}"}).status_code == 404


def test_streaming_records_the_same_ledger(app) -> None:  # type: ignore[no-untyped-def]
    ledgers = []
    for stream in (False, True):
        sid, token, _ = run_agent(app, stream=stream)
        t = httpx.get(f"{app.base_url}/sessions/{sid}/trajectory",
                      headers={"Authorization": f"Bearer {token}"}).json()
        ledgers.append((t["tokens"], t["mask"], t["logprobs"], t["provenance"]))
    assert ledgers[0] == ledgers[1]


def test_models_and_sessionless_calls(app) -> None:  # type: ignore[no-untyped-def]
    from openai import OpenAI

    c = OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in c.models.list().data] == ["rl360"]
    r = c.chat.completions.create(model="rl360", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == "ok"
    r = c.completions.create(model="rl360", prompt="hello", max_tokens=4)
    assert r.choices[0].text


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b"", 400),
        (b'{"messages": "hi"}', 422),
        (b'{"messages": [{"content": "no role"}]}', 422),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 1000}', 400),
        (b'{"messages": [{"role": "user", "content": "x"}], "input_ids": [1]}', 400),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 422),
    ],
)
def test_malformed_bodies_get_4xx_with_a_message(app, body: bytes, status: int) -> None:  # type: ignore[no-untyped-def]
    sid, token = open_session(app.base_url)
    r = httpx.post(f"{app.base_url}/sessions/{sid}/v1/chat/completions", content=body,
                   headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


def test_auth_and_unknown_sessions(app) -> None:  # type: ignore[no-untyped-def]
    sid, token = open_session(app.base_url)
    url = f"{app.base_url}/sessions/{sid}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(url, json=body).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = httpx.post(f"{app.base_url}/sessions/deadbeef/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 404
    assert httpx.delete(f"{app.base_url}/sessions/deadbeef").status_code == 401  # no token
    assert httpx.delete(f"{app.base_url}/sessions/deadbeef",
                        headers={"Authorization": f"Bearer {token}"}).status_code == 404
