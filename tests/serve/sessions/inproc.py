"""The session server's HTTP app in-process: Gateway + build_app over local SessionShards
(scripted engine, tiny tokenizer), driven through httpx's ASGI transport. No Ray, no Serve."""

from __future__ import annotations

from typing import Any

import httpx

from rl360.recipe import EngineSection, ModelSection, ServeSection
from rl360.serve.engines.scripted import ScriptedBackend
from rl360.serve.sessions.http import Gateway, LocalShards, build_app
from rl360.serve.sessions.service import LocalEngineClient, SessionService
from rl360.serve.sessions.shard import SessionShard

API_KEY = "server-key"


def make_app(shards: int = 2, rules: list[list[str]] | None = None,
             **serve: Any) -> tuple[Any, LocalShards]:
    """`serve`: [serve] keys (the shards' and the gateway's section)."""
    from rl360.policies.chat import ChatRenderer
    from rl360.policies.loading import load_tokenizer

    renderer = ChatRenderer(load_tokenizer("tiny", "auto"))
    backend = ScriptedBackend(EngineSection(options={"rules": rules or []}), ModelSection(),
                              tokenizer=renderer.tokenizer)
    serve_cfg = ServeSection(**{"api_key": API_KEY, **serve})
    local = LocalShards([SessionShard.over(SessionService(
        renderer, LocalEngineClient(backend), serve_cfg, max_model_len=512, model_name="rl360"))
        for _ in range(shards)])
    return build_app(Gateway(local, serve_cfg, "rl360")), local


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                             timeout=30)


def key() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


async def open_session(c: httpx.AsyncClient) -> tuple[str, str]:
    r = await c.post("/sessions", json={"metadata": {"task_id": "t"}}, headers=key())
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["token"]
