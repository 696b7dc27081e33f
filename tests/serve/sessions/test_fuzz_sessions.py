"""Property-based fuzzing of the session server, in-process (Gateway +
build_app over local shards, httpx's ASGI transport): the OpenAI request schema with hostile
values and wrong types, the session routes with wrong tokens and unknown ids, raw and huge and
nested bodies, and clients that disconnect mid-request or mid-stream. Properties: no 5xx,
every error is a JSON error without a traceback, and no response ever shows one session's
ledger to a request that does not hold that session's token (two sessions hold a secret).
Examples are derandomized (the same few thousand every run); run with
`--hypothesis-seed=N` and without `derandomize` locally to explore further."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.sessions.inproc import API_KEY, client, make_app, open_session

pytestmark = pytest.mark.timeout(900)
SETTINGS = settings(deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
SECRET = {"A": "SECRETALPHA", "B": "SECRETBRAVO"}
RULES = [["list files", '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>']]


class World:
    """One app, one event loop and two sessions that hold a secret, for every example."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.app, self.local = make_app(shards=2, rules=RULES, max_body_bytes=64 << 10,
                                        max_messages=64, max_sessions_per_shard=200,
                                        max_session_nodes=400)
        self.client = client(self.app)
        self.sessions: dict[str, tuple[str, str]] = {}
        self.response_ids: dict[str, set[str]] = {"A": set(), "B": set()}
        self.requests = 0
        for name in ("A", "B"):
            sid, token = self.run(open_session(self.client))
            self.sessions[name] = (sid, token)
            r = self.run(self.client.post(
                f"/sessions/{sid}/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                json={"messages": [{"role": "user", "content": SECRET[name]}]}))
            assert r.status_code == 200, r.text

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def send(self, method: str, path: str, auth: bytes | None, body: bytes | None) -> Any:
        headers = [(b"content-type", b"application/json")]
        if auth is not None:
            headers.append((b"authorization", auth))
        self.requests += 1
        return self.run(self.client.request(method, path, content=body, headers=headers))

    def owner(self, token: bytes | None) -> str | None:
        for name, (_, t) in self.sessions.items():
            if token == f"Bearer {t}".encode():
                return name
        return None


@pytest.fixture(scope="module")
def world() -> Any:
    w = World()
    yield w
    w.run(w.client.aclose())
    w.loop.close()
    print(f"fuzzed requests: {w.requests}")


def check(world: World, r: Any, auth: bytes | None, body: bytes | None,
          target: str | None) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    assert "Traceback" not in r.text
    if r.status_code >= 400 and r.status_code not in (404, 405):
        assert json.loads(r.text)["error"]["message"]
    owner = world.owner(auth)
    for name, secret in SECRET.items():
        if secret in r.text and (body is None or secret.encode() not in body):
            assert owner == name == target, f"{name}'s ledger shown to {owner or 'a stranger'}"
    if target is not None and r.status_code == 200 and owner != target:
        raise AssertionError(f"a request without {target}'s token was answered 200")
    if target is not None and r.status_code == 200 and r.headers.get("content-type", "").startswith(
            "application/json"):
        rid = json.loads(r.text).get("id")
        if isinstance(rid, str) and rid.startswith(("chatcmpl", "cmpl")):
            world.response_ids[target].add(rid)


# ---------------------------------------------------------------------- strategies

HOSTILE = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["", "\x00", "{{ 7*7 }}", "{% for x in y %}", "<|im_end|>", "<|im_start|>",
                     "<tool_call>", "</tool_call>{", "\u202e\ufeff", "../../etc/passwd", "%00",
                     "A" * 3000, "é" * 500, "null", "[]", "{}", "\\u0000", "\ud7ff"]),
)
NUMBER = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=False), st.none())
LEAF = st.one_of(st.none(), st.booleans(), NUMBER, HOSTILE)
ANY = st.recursive(LEAF, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(HOSTILE, ch, max_size=4),
                   max_leaves=16)
TOOL_CALL = st.fixed_dictionaries({
    "id": HOSTILE, "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": HOSTILE, "arguments": st.one_of(
        HOSTILE, ANY.map(json.dumps))})})
CONTENT = st.one_of(st.none(), HOSTILE, st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "x"]), "text": HOSTILE}), max_size=3))
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "developer"]), HOSTILE)},
    optional={"content": CONTENT, "tool_calls": st.lists(TOOL_CALL, max_size=2),
              "tool_call_id": HOSTILE, "name": HOSTILE, "reasoning_content": HOSTILE})
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": HOSTILE}, optional={"description": HOSTILE,
                                 "parameters": st.dictionaries(HOSTILE, ANY, max_size=3)})})
CHAT = st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=5)}, optional={
    "model": HOSTILE, "tools": st.lists(TOOL, max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), ANY),
    "temperature": NUMBER, "top_p": NUMBER, "top_k": NUMBER, "max_tokens": NUMBER,
    "max_completion_tokens": NUMBER, "stop": st.one_of(HOSTILE, st.lists(HOSTILE, max_size=20)),
    "stop_token_ids": st.lists(st.integers(-5, 100_000), max_size=4), "seed": NUMBER,
    "n": st.integers(-2, 20), "stream": st.booleans(), "logprobs": st.booleans(),
    "stream_options": st.one_of(ANY, st.just({"include_usage": True})),
    "input_ids": ANY, "prompt_token_ids": ANY})
COMPLETION = st.fixed_dictionaries({"prompt": st.one_of(HOSTILE, st.lists(
    st.integers(-5, 100_000), max_size=8))}, optional={
    "max_tokens": NUMBER, "temperature": NUMBER, "n": st.integers(-2, 3), "stream": st.booleans(),
    "logprobs": NUMBER, "stop": HOSTILE, "seed": NUMBER})
WRONG_TYPES = st.dictionaries(st.sampled_from(["messages", "tools", "n", "stream", "prompt",
                                               "metadata", "matcher", "temperature"]), ANY)


def nested(depth: int) -> bytes:
    return b'{"messages": [{"role": "user", "content": "x"}], "tools": ' + b"[" * depth + \
        b"]" * depth + b"}"


RAW = st.one_of(
    st.binary(max_size=200),
    st.integers(10, 5000).map(nested),
    st.integers(60 << 10, 80 << 10).map(lambda n: b'{"messages": [{"role": "user", "content": "'
                                        + b"z" * n + b'"}]}'),
    st.sampled_from([b"", b"null", b"[]", b"{}", b'{"messages": null}', b"\xff\xfe",
                     b'{"messages": [], "n": 1e999}', b'{"prompt": [1e400]}']),
)
BODY = st.one_of(CHAT.map(lambda b: json.dumps(b).encode()),
                 COMPLETION.map(lambda b: json.dumps(b).encode()),
                 WRONG_TYPES.map(lambda b: json.dumps(b).encode()), RAW)

ROUTES = [("POST", "/sessions/{sid}/v1/chat/completions"), ("POST", "/sessions/{sid}/v1/completions"),
          ("GET", "/sessions/{sid}/trajectory"), ("DELETE", "/sessions/{sid}"),
          ("GET", "/sessions/{sid}/v1/models"), ("POST", "/v1/chat/completions"),
          ("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/stats"),
          ("POST", "/sessions"), ("GET", "/healthz"), ("PUT", "/sessions/{sid}"),
          ("GET", "/sessions/{sid}/v1/chat/completions"), ("POST", "/nope/{sid}")]
SIDS = st.one_of(st.sampled_from(["A", "B", "A", "B"]), st.just("deadbeef" * 4),
                 st.text(min_size=1, max_size=40))
AUTH = st.one_of(st.sampled_from(["A", "B", "key", None]), st.binary(max_size=60),
                 HOSTILE.map(lambda s: ("Bearer " + s).encode("utf-8", "surrogatepass")))


def resolve(world: World, sid_choice: str, auth_choice: Any) -> tuple[str, str | None, bytes | None]:
    target = sid_choice if sid_choice in world.sessions else None
    sid = world.sessions[sid_choice][0] if target else sid_choice
    if auth_choice in world.sessions:
        auth: bytes | None = f"Bearer {world.sessions[auth_choice][1]}".encode()
    elif auth_choice == "key":
        auth = f"Bearer {API_KEY}".encode()
    else:
        auth = auth_choice
    return urllib.parse.quote(sid, safe=""), target, auth


# ---------------------------------------------------------------------- properties


@settings(SETTINGS, max_examples=1200)
@given(body=CHAT, sid=st.sampled_from(["A", "B", None]), auth=st.sampled_from(["A", "B", "key"]))
def test_openai_chat_schema(world: World, body: dict[str, Any], sid: str | None, auth: str) -> None:
    path_sid, target, header = resolve(world, sid or "", auth)
    path = f"/sessions/{path_sid}/v1/chat/completions" if target else "/v1/chat/completions"
    raw = json.dumps(body).encode()
    check(world, world.send("POST", path, header, raw), header, raw, target)


@settings(SETTINGS, max_examples=1800)
@given(route=st.sampled_from(ROUTES), sid=SIDS, auth=AUTH, body=st.one_of(st.none(), BODY))
def test_session_routes(world: World, route: tuple[str, str], sid: str, auth: Any,
                        body: bytes | None) -> None:
    method, template = route
    path_sid, target, header = resolve(world, sid, auth)
    if method == "DELETE" and target is not None and world.owner(header) == target:
        return  # closing A or B would end the experiment; other closes are fine
    path = template.format(sid=path_sid)
    session_data = "{sid}" in template and not template.startswith("/nope") and \
        not template.endswith("/models")  # the model list is the same for everyone
    check(world, world.send(method, path, header, body), header, body,
          target if session_data else None)


@settings(SETTINGS, max_examples=150)
@given(cut=st.integers(0, 3), stream=st.booleans(), send_fails_after=st.integers(1, 6))
def test_disconnects_mid_request_and_mid_stream(world: World, cut: int, stream: bool,
                                                send_fails_after: int) -> None:
    sid, token = world.sessions["A"]
    body = json.dumps({"messages": [{"role": "user", "content": "list files"}],
                       "stream": stream}).encode()
    parts = [body[: len(body) // 2], body[len(body) // 2 :]]
    events = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
              for i, p in enumerate(parts)][: 2 if cut == 0 else cut - 1]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return events.pop(0) if events else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if len(sent) > send_fails_after:
            raise OSError("connection reset by peer")

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": f"/sessions/{sid}/v1/chat/completions", "raw_path": b"",
             "query_string": b"", "root_path": "", "server": ("test", 80), "client": ("c", 1),
             "headers": [(b"authorization", f"Bearer {token}".encode()),
                         (b"content-type", b"application/json")]}
    world.requests += 1
    world.run(world.app(scope, receive, send))  # nothing escapes the app
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) <= 1 and all(m["status"] < 500 for m in starts), starts


def test_zz_no_response_id_landed_in_another_session(world: World) -> None:
    """Every 200 a session's token got is a node of that session's forest, and of no other."""
    forests = {}
    for name, (sid, token) in world.sessions.items():
        shard = next(s for s in world.local.shards if sid in s.svc.sessions)
        forests[name] = {n["response_id"] for n in shard.svc.trajectory(sid, token)["forest"]}
    for name, ids in world.response_ids.items():
        assert ids <= forests[name]
        assert not ids & set().union(*(f for n, f in forests.items() if n != name))
    assert world.requests >= 3000, world.requests
