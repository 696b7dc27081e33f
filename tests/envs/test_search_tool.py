"""The agents' `search` tool against a stand-in HTTP service (the real deployment is covered in
tests/serve/search): hits as text, failures as error results the model reads, and which
toolboxes get the tool."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from rl360.envs.sandbox import SandboxLimits
from rl360.envs.search_tool import make_toolbox, search_tool
from rl360.envs.toolenv import ToolEnv
from rl360.types import FunctionCall, Task, ToolCall

HITS = [{"id": "module:json#2", "doc_id": "module:json", "title": "json module",
         "snippet": "json.dumps: Serialize obj to a JSON formatted str.", "score": 5.1}]
SANDBOX: Any = SimpleNamespace(limits=SandboxLimits())


def call(args: dict[str, Any] | str) -> ToolCall:
    raw = args if isinstance(args, str) else json.dumps(args)
    return ToolCall(id="c1", function=FunctionCall(name="search", arguments=raw))


@pytest.fixture
async def service():  # type: ignore[no-untyped-def]
    seen: list[dict[str, Any]] = []

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if body["query"] == "boom":
            return web.json_response({"error": "index broke"}, status=500)
        return web.json_response({"hits": HITS if body["query"] != "nothing" else []})

    app = web.Application()
    app.router.add_post("/search", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}/search", seen=seen)
    finally:
        await runner.cleanup()


async def test_search_tool_returns_hits_as_text(service) -> None:  # type: ignore[no-untyped-def]
    box = make_toolbox(SANDBOX, ["search"], {"search": {"url": service.url, "default_k": 4}})
    assert [s.function.name for s in box.specs] == ["search"]
    res = await box.call(call({"query": "serialize json", "k": 99}))
    assert res.ok and "[1] json module (module:json#2)" in res.content
    assert "Serialize obj to a JSON formatted str." in res.content
    assert service.seen[-1] == {"query": "serialize json", "k": 20}  # k capped at 20
    await box.call(call({"query": "x"}))
    assert service.seen[-1]["k"] == 4  # the service's default_k
    assert (await box.call(call({"query": "nothing"}))).content == "no results"


async def test_search_failures_are_results_the_model_reads(service) -> None:  # type: ignore[no-untyped-def]
    box = make_toolbox(SANDBOX, ["search"], {"search": {"url": service.url}})
    res = await box.call(call({"query": "boom"}))
    assert not res.ok and "HTTP 500" in res.content and "index broke" in res.content
    res = await box.call(call({"query": "   "}))
    assert not res.ok and "empty" in res.content
    res = await box.call(call({"k": 3}))
    assert not res.ok and "missing required argument(s): query" in res.content
    dead = search_tool("http://127.0.0.1:9/search", timeout_s=2)  # nothing listens on port 9
    res = await dead.run(SANDBOX, {"query": "x"}, box)
    assert not res.ok and res.content.startswith("error: search")


def test_which_toolboxes_get_search() -> None:
    svc = {"search": {"url": "http://127.0.0.1:1/search"}}
    assert "search" in {s.function.name for s in make_toolbox(SANDBOX, None, svc).specs}
    assert "search" not in {s.function.name for s in make_toolbox(SANDBOX, None, {}).specs}
    names = {s.function.name for s in make_toolbox(SANDBOX, ["bash", "search"], svc).specs}
    assert names == {"bash", "search"}
    with pytest.raises(ValueError, match=r"\['search'\] need their service: set \[search\] index"):
        make_toolbox(SANDBOX, ["search"], {})


async def test_tool_env_takes_the_task_tool_list() -> None:
    env = ToolEnv()
    env.services = {"search": {"url": "http://127.0.0.1:1/search"}}
    start = await env.setup(Task(id="t", prompt="q?", kind="tools",
                                 data={"answer": "a", "tools": ["search"]}), SANDBOX)
    assert [t.function.name for t in start.tools] == ["search"]
