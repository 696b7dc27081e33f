"""The session server never answers 5xx to bad input: each guard on its
own, in-process (tests/serve/sessions/inproc.py). Fuzzing is in test_fuzz_sessions.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rl360.recipe import ServeSection
from rl360.serve.sessions.http import Gateway, LocalShards
from tests.serve.sessions.inproc import client, key, make_app, open_session

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def sess(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def is_error(r: Any, status: int) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["message"] and "Traceback" not in r.text


async def test_body_size_cap_is_413_declared_or_streamed() -> None:
    app, _ = make_app(max_body_bytes=4096)
    async with client(app) as c:
        sid, token = await open_session(c)
        url = f"/sessions/{sid}/v1/chat/completions"
        big = {"messages": [{"role": "user", "content": "x" * 10_000}]}
        is_error(await c.post(url, json=big, headers=sess(token)), 413)

        async def chunks():  # type: ignore[no-untyped-def]
            for _ in range(10):
                yield b"x" * 1000  # no Content-Length: the cap holds while reading

        is_error(await c.post(url, content=chunks(), headers=sess(token)), 413)


async def test_nesting_and_message_count_are_400_before_rendering() -> None:
    app, _ = make_app(max_messages=3)
    async with client(app) as c:
        sid, token = await open_session(c)
        url = f"/sessions/{sid}/v1/chat/completions"
        for depth in (100, 200_000):
            body = b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": ' + \
                b"[" * depth + b"]" * depth + b"}"
            is_error(await c.post(url, content=body, headers=sess(token)), 400)
        is_error(await c.post("/sessions", content=b'{"metadata": {"a": ' + b"[" * 500 +
                              b"]" * 500 + b"}}", headers=key()), 400)
        many = {"messages": [{"role": "user", "content": "x"}] * 4}
        is_error(await c.post(url, json=many, headers=sess(token)), 400)
        huge = {"messages": [{"role": "user", "content": "y" * 2_000_000}]}
        r = await c.post(url, json=huge, headers=sess(token))
        is_error(r, 400)
        assert "context" in r.json()["error"]["message"]


async def test_rendering_runs_off_the_event_loop() -> None:
    app, local = make_app()
    svc = local.shards[0].svc
    threads: list[str] = []
    render = svc.renderer.render

    def spy(*a: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        return render(*a, **kw)

    svc.renderer.render = spy  # one renderer, shared by the shards
    try:
        async with client(app) as c:
            sid, token = await open_session(c)
            r = await c.post(f"/sessions/{sid}/v1/chat/completions", json=CHAT, headers=sess(token))
            assert r.status_code == 200, r.text
    finally:
        del svc.renderer.render
    assert threads and all(t.startswith("rl360-render") for t in threads)


async def test_token_ids_outside_the_vocabulary_are_400() -> None:
    app, local = make_app()
    vocab = local.shards[0].svc.vocab_size
    async with client(app) as c:
        sid, token = await open_session(c)
        for prompt in ([1, 2, vocab], [-1], [10**12]):
            r = await c.post(f"/sessions/{sid}/v1/completions", json={"prompt": prompt},
                             headers=sess(token))
            assert r.status_code in (400, 422), r.text
        r = await c.post(f"/sessions/{sid}/v1/chat/completions",
                         json={**CHAT, "stop_token_ids": [vocab + 5]}, headers=sess(token))
        is_error(r, 400)
        r = await c.post("/v1/completions", json={"prompt": [vocab]}, headers=key())
        is_error(r, 400)
        r = await c.post(f"/sessions/{sid}/v1/completions", json={"prompt": [1, 2, 3]},
                         headers=sess(token))
        assert r.status_code == 200, r.text


async def test_malformed_and_non_ascii_credentials_are_401() -> None:
    app, _ = make_app()
    async with client(app) as c:
        sid, _token = await open_session(c)
        url = f"/sessions/{sid}/v1/chat/completions"
        for header in ("Bearer tökén".encode(), b"Bearer \xff\xfe", b"Basic abc", b"Bearer",
                       b"bearer  ", ("Bearer " + "x" * 10_000).encode(), b"Bearer a\x01b"):
            r = await c.post(url, json=CHAT, headers=[(b"authorization", header)])
            is_error(r, 401)
            r = await c.post("/sessions", json={}, headers=[(b"authorization", header)])
            is_error(r, 401)
        r = await c.get(f"/sessions/{sid}/trajectory", headers=[(b"authorization", "Bearer é".encode())])
        is_error(r, 401)


async def test_server_key_guards_sessions_sessionless_and_stats() -> None:
    app, _ = make_app()
    async with client(app) as c:
        for method, path, body in (("POST", "/sessions", {}), ("POST", "/v1/chat/completions", CHAT),
                                   ("POST", "/v1/completions", {"prompt": "a"}),
                                   ("GET", "/v1/models", None), ("GET", "/stats", None)):
            is_error(await c.request(method, path, json=body), 401)
            is_error(await c.request(method, path, json=body, headers=sess("wrong")), 401)
            r = await c.request(method, path, json=body, headers=key())
            assert r.status_code in (200, 201), r.text


def test_a_non_loopback_host_needs_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RL360_SERVE_API_KEY", raising=False)
    with pytest.raises(ValueError, match=r"serve\.api_key"):
        Gateway(LocalShards([]), ServeSection(host="0.0.0.0"), "m")
    Gateway(LocalShards([]), ServeSection(host="127.0.0.1"), "m")  # loopback: optional
    monkeypatch.setenv("RL360_SERVE_API_KEY", "k")
    assert Gateway(LocalShards([]), ServeSection(host="0.0.0.0"), "m").api_key == "k"


async def test_dead_shard_is_503_with_retry_after() -> None:
    app, local = make_app(shards=2)
    async with client(app) as c:
        sid, token = await open_session(c)
        local.down.add(0)
        local.down.add(1)
        for r in (await c.get("/stats", headers=key()),
                  await c.post(f"/sessions/{sid}/v1/chat/completions", json=CHAT,
                               headers=sess(token)),
                  await c.post("/sessions", json={}, headers=key())):
            is_error(r, 503)
            assert r.headers["retry-after"]


async def test_per_shard_session_cap_is_429() -> None:
    app, _ = make_app(shards=1, max_sessions_per_shard=2)
    async with client(app) as c:
        await open_session(c)
        await open_session(c)
        r = await c.post("/sessions", json={}, headers=key())
        is_error(r, 429)
        assert "serve.max_sessions_per_shard" in r.json()["error"]["message"]


async def test_anything_unexpected_is_one_json_error_without_a_traceback() -> None:
    app, local = make_app()

    async def broken(*a: Any) -> Any:
        raise RuntimeError("secret internal detail")

    for shard in local.shards:
        shard.chat = broken
    async with client(app) as c:
        sid, token = await open_session(c)
        r = await c.post(f"/sessions/{sid}/v1/chat/completions", json=CHAT, headers=sess(token))
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    assert "secret internal detail" not in r.text and "Traceback" not in r.text


async def test_disconnect_mid_stream_keeps_the_ledger_and_raises_nothing() -> None:
    app, local = make_app()
    async with client(app) as c:
        sid, token = await open_session(c)
    body = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}'
    sent: list[dict[str, Any]] = []
    received = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return received.pop(0) if received else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and len(sent) > 2:
            raise OSError("connection reset by peer")

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": f"/sessions/{sid}/v1/chat/completions", "raw_path": b"",
             "query_string": b"", "root_path": "", "server": ("test", 80), "client": ("c", 1),
             "headers": [(b"authorization", f"Bearer {token}".encode()),
                         (b"content-type", b"application/json")]}
    await app(scope, receive, send)  # no exception escapes, no second status line
    assert sum(m["type"] == "http.response.start" for m in sent) == 1
    assert sent[0]["status"] == 200
    svc = next(s.svc for s in local.shards if sid in s.svc.sessions)
    assert len(svc.trajectory(sid, token)["forest"]) == 1  # committed before streaming


async def test_the_vocabulary_is_the_models_not_only_the_tokenizers() -> None:
    """The tiny model has 320 embedding rows for a 263-token tokenizer and may generate ids
    above 263; a prompt that extends its ledger holds them, so they must pass."""
    from rl360.recipe import EngineSection, ModelSection
    from rl360.serve.engines.scripted import ScriptedBackend
    from rl360.serve.sessions.openai_types import ApiError, CompletionRequest
    from rl360.serve.sessions.service import LocalEngineClient, SessionService
    from rl360.serve.sessions.shard import model_vocab_size

    vocab = model_vocab_size("tiny")
    _app, local = make_app()
    renderer = local.shards[0].svc.renderer
    assert vocab > len(renderer.tokenizer)
    be = ScriptedBackend(EngineSection(), ModelSection(), tokenizer=renderer.tokenizer)
    svc = SessionService(renderer, LocalEngineClient(be), ServeSection(), max_model_len=512,
                         model_name="m", vocab_size=vocab)
    ok = await svc.complete(None, None, CompletionRequest(prompt=[1, vocab - 1]))
    assert not isinstance(ok, ApiError), ok
    bad = await svc.complete(None, None, CompletionRequest(prompt=[1, vocab]))
    assert isinstance(bad, ApiError) and bad.status == 400 and bad.code == "bad_token_id"
