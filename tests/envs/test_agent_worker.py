"""The agent worker without Ray: an agent program (tests/envs/agents/probe_agent.py, stdlib
only) runs in a bwrap sandbox on a Harbor task, its model calls going through the session
bridge to a stand-in session server on the host's loopback. What it may reach (its own session
only), how each way it can end is filed (scored vs infrastructure), and that the verifier
scores what it did, not what it claims."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from rl360.envs.agent_worker import AgentWorkerEnv, run_agent_worker
from rl360.envs.api import open_sandbox
from rl360.envs.sandbox import unavailable_reason
from rl360.envs.session_bridge import SessionEndpoint
from rl360.envs.tasks import load_harbor_task
from rl360.recipe import EnvSection, SandboxLimits

pytestmark = pytest.mark.skipif(unavailable_reason("bwrap") is not None,
                                reason=f"bwrap sandbox: {unavailable_reason('bwrap')}")
REPO = Path(__file__).resolve().parents[2]
TASK = REPO / "examples/harbor/count-ok-rows"
AGENTS = Path(__file__).resolve().parent / "agents"
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 64}


class StandIn:
    """A session server with one open session (id s1, token tok) on the host's loopback: it
    answers its chat route (or `status`) and records every request it gets."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.seen: list[tuple[str, str, dict[str, Any]]] = []  # (path, authorization, body)
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        self.seen.append((request.path, request.headers.get("Authorization", ""), body))
        if self.status != 200:
            return web.json_response({"error": {"message": "down"}}, status=self.status)
        msg = {"role": "assistant", "content": "done"}
        return web.json_response({
            "id": "r", "object": "chat.completion", "created": 0, "model": "policy",
            "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


@pytest.fixture
async def server(request: pytest.FixtureRequest) -> AsyncIterator[StandIn]:
    s = StandIn(getattr(request, "param", 200))
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", s.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    s.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield s
    finally:
        await runner.cleanup()


async def episode(port: int, *argv: str, cfg: EnvSection | None = None,
                  **params: Any) -> Any:
    task = load_harbor_task(TASK)
    env = AgentWorkerEnv(command=("{python}", str(AGENTS / "probe_agent.py"), *argv),
                         mounts=(str(AGENTS),), **params)
    sandbox = open_sandbox(env, task, "bwrap", SandboxLimits())
    try:
        return await run_agent_worker(env, task, sandbox,
                                      SessionEndpoint(f"http://127.0.0.1:{port}", "s1", "tok"),
                                      SAMPLING, cfg or EnvSection())
    finally:
        await sandbox.close()
        await env.close()


async def test_an_agent_reaches_its_own_session_and_nothing_else(server: StandIn,
                                                                 tmp_path: Path) -> None:
    # a host Unix socket that is listening (as Ray's raylet and object store sockets are)
    unix_path = str(tmp_path / "host.sock")
    host_sock = socket.socket(socket.AF_UNIX)
    host_sock.bind(unix_path)
    host_sock.listen(1)
    try:
        res = await episode(server.port, "hostile", f"{server.port},{unix_path},{TASK}")
    finally:
        host_sock.close()
    # the stand-in saw one request: the report, on the episode's own session and token
    assert [(p, a) for p, a, _ in server.seen] == [("/sessions/s1/v1/chat/completions",
                                                     "Bearer tok")]
    report = json.loads(server.seen[0][2]["messages"][0]["content"].removeprefix("REPORT "))
    assert report == {
        "other_session": 404, "open_session": 404, "close_own_session": 404, "stats": 404,
        "wrong_token": 401,
        "host_loopback": "ConnectionRefusedError",  # its own network namespace
        "host_unix_socket": "FileNotFoundError", "ray_tmp": "FileNotFoundError",
        "task_tests_on_host": "FileNotFoundError", "tests_dir": "FileNotFoundError",
    }, report
    # the recipe's sampling, not the agent's
    body = server.seen[0][2]
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.7, 0.9, 64)
    assert res.counters["agent_refused_requests"] == 5 and res.counters["agent_model_calls"] == 1
    # its forged reward file did not survive the clean room: the verifier scored the work
    assert res.status == "ok", res.reason
    assert res.reward is not None and res.reward.value == 0.0


async def test_an_agent_that_solves_the_task_is_scored_by_the_verifier(server: StandIn) -> None:
    res = await episode(server.port, "solve")
    assert res.status == "ok", res.reason
    assert res.reward is not None and res.reward.value == 1.0
    assert set(res.timings) >= {"sandbox_start_s", "setup_s", "rollout_s", "verify_s",
                                "total_s"}


@pytest.mark.parametrize("mode, status, reward, component", [
    ("crash", "error", 0.0, "reward"),  # exited 3: scored, and verified
    ("silent", "error", 0.0, "agent_no_model_call"),  # never asked: scored 0, not verified
])
async def test_scored_failures(server: StandIn, mode: str, status: str, reward: float,
                               component: str) -> None:
    res = await episode(server.port, mode)
    assert res.status == status, res.reason
    assert res.reward is not None and res.reward.value == reward
    assert component in res.reward.components
    assert ("verify_s" in res.timings) == (mode == "crash")


async def test_an_agent_past_its_budget_is_a_scored_timeout(server: StandIn) -> None:
    res = await episode(server.port, "hang", timeout_s=3.0)
    assert res.status == "timeout", res.reason
    assert res.reward is not None and res.reward.value == 0.0  # verified: nothing was done
    assert res.timings["rollout_s"] < 30


@pytest.mark.parametrize("server", [503], indirect=True)
async def test_a_session_server_failing_under_the_agent_is_infrastructure(
        server: StandIn) -> None:
    res = await episode(server.port, "ask")
    assert res.status == "infra_error" and res.reward is None
    assert "503" in res.reason


async def test_an_unreachable_session_server_is_infrastructure() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = await episode(port, "ask")
    assert res.status == "infra_error" and res.reward is None, res.reason
    assert "unreachable" in res.reason


async def test_a_missing_agent_command_is_infrastructure(server: StandIn) -> None:
    task = load_harbor_task(TASK)
    env = AgentWorkerEnv(command=("/no/such/agent",))
    sandbox = open_sandbox(env, task, "bwrap", SandboxLimits())
    try:
        res = await run_agent_worker(env, task, sandbox, SessionEndpoint(
            f"http://127.0.0.1:{server.port}", "s1", "tok"), SAMPLING, EnvSection())
    finally:
        await sandbox.close()
        await env.close()
    assert res.status == "infra_error", res.reason
    assert "could not start" in res.reason


def test_bad_agent_parameters_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown agent 'nope'"):
        AgentWorkerEnv(agent="nope")
    with pytest.raises(ValueError, match=r"needs env\.params\.command"):
        AgentWorkerEnv(agent="command")
    with pytest.raises(ValueError, match="agent module 'no_such_module_xyz'"):
        AgentWorkerEnv(command=("x",), modules=("no_such_module_xyz",))
    with pytest.raises(ValueError, match="does not exist"):
        AgentWorkerEnv(command=("x",), mounts=("/no/such/dir",))
    if "minisweagent" in sys.modules or _installed("mini-swe-agent"):
        with pytest.raises(ValueError, match=r"asks for version 0\.0\.1"):
            AgentWorkerEnv(agent="mini-swe-agent", version="0.0.1")


def _installed(dist: str) -> bool:
    from rl360.envs.agent_programs import installed_version

    return installed_version(dist) is not None


async def test_the_bridge_closes_at_once_with_a_request_under_way(tmp_path: Path) -> None:
    """A process the agent left behind may be waiting on a generation when the episode ends:
    closing the bridge does not wait for it (the verifier is next)."""
    import asyncio
    import time

    import aiohttp

    from rl360.envs.session_bridge import SessionBridge

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/sessions/s1/v1/chat/completions", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    bridge = SessionBridge(SessionEndpoint(f"http://127.0.0.1:{port}", "s1", "tok"),
                           directory=str(tmp_path / "bridge"))
    await bridge.start()
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(bridge.socket_path)) as c:
        call = asyncio.ensure_future(c.post("http://agent/v1/chat/completions", json={},
                                            headers={"Authorization": "Bearer tok"}))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        await bridge.close()
        assert time.monotonic() - t0 < 5
        call.cancel()
    await runner.cleanup()
    assert not (tmp_path / "bridge").exists()
