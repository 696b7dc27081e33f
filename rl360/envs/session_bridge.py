"""The session bridge: the one way an agent program inside a sandbox reaches the policy.

Per episode the env actor serves an HTTP endpoint on a Unix socket in a directory of its own,
which the sandbox sees read-only (the sandbox has no network: its relay, envs/sandbox/relay.py,
turns the agent's `http://127.0.0.1:PORT/v1` into connections to this socket). The bridge
forwards exactly three routes to the episode's own session on the session server, with the
episode's token:

    GET  /v1/models              -> {base_url}/sessions/{sid}/v1/models
    POST /v1/chat/completions    -> {base_url}/sessions/{sid}/v1/chat/completions
    POST /v1/completions         -> {base_url}/sessions/{sid}/v1/completions

Anything else (another session's path, opening or closing a session, the sessionless /v1/*,
/stats) gets a 404 from the bridge itself, and a request without the episode's bearer token a
401: an agent reaches its own session and nothing else, and a token it learns from somewhere
cannot be spent here on another session. The recipe's sampling (`train.sampling`) replaces what
the agent asks for (temperature, top_p, top_k, stop_token_ids; max_tokens capped at the
recipe's): the trainer assumes the sampling it was told, whatever harness sampled.

The bridge counts what it saw (`BridgeStats`): model calls answered, answers the agent caused
(4xx), and infrastructure failures (the session server unreachable or answering 5xx, or 401/404
for a session the env actor opened and did not close). The agent worker files an episode with
any infrastructure failure as `infra_error` (re-run), never as the agent's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import tempfile
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

log = logging.getLogger(__name__)

ROUTES = {
    ("GET", "/v1/models"): "models",
    ("POST", "/v1/chat/completions"): "chat/completions",
    ("POST", "/v1/completions"): "completions",
}
GENERATING = ("chat/completions", "completions")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "stop_token_ids", "priority")
INFRA_STATUSES = (401, 404)  # the bridge sends the episode's own sid and token: a lost session
SOCKET_NAME = "session.sock"
CLOSE_GRACE_S = 1.0


class SessionEndpoint(msgspec.Struct, frozen=True):
    """An episode's session on the session server: what its agent may reach."""

    base_url: str  # the session server, e.g. http://127.0.0.1:8000
    session_id: str
    token: str

    @property
    def url(self) -> str:
        return f"{self.base_url.rstrip('/')}/sessions/{self.session_id}/v1"


class BridgeStats(msgspec.Struct):
    requests: int = 0  # every request the agent sent
    model_calls: int = 0  # generations the session server answered (2xx)
    client_errors: int = 0  # 4xx answers the agent's requests caused
    refused: int = 0  # requests the bridge itself refused (route, token)
    infra: list[str] = msgspec.field(default_factory=list)  # infrastructure failures seen


def _bearer_is(header: str | None, token: str) -> bool:
    """Whether `Authorization: Bearer <token>` names `token` (constant time)."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip().isascii():
        return False
    return secrets.compare_digest(given.strip().encode(), token.encode())


def bridge_root() -> str:
    """Where bridge directories go: a host directory the sandbox's own mounts do not cover
    (bwrap puts a private tmpfs on /tmp, which would hide a bind below it)."""
    for d in (os.environ.get("RL360_BRIDGE_DIR", ""), "/var/tmp", "/dev/shm"):
        if d and os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK):
            return d
    return tempfile.gettempdir()


def new_bridge_dir() -> str:
    """A fresh bridge directory's path (not created): `bridge_root()`/rl360-bridge-<random>."""
    return os.path.join(bridge_root(), f"rl360-bridge-{secrets.token_hex(12)}")


class SessionBridge:
    """Serve one episode's bridge on `<directory>/session.sock` until `close()`. The directory
    (made by `start`, default `new_bridge_dir()`) is what the sandbox binds read-only; it is
    world-readable (the sandbox's uid, 65534 under root, must reach it): the episode's token,
    not the path, is what keeps other host users out."""

    def __init__(self, endpoint: SessionEndpoint, sampling: dict[str, Any] | None = None,
                 call_timeout_s: float = 300.0, max_body_bytes: int = 32 << 20,
                 directory: str | None = None,
                 http: aiohttp.ClientSession | None = None) -> None:
        self.endpoint = endpoint
        self.sampling = dict(sampling or {})
        self.call_timeout_s = call_timeout_s
        self.max_body_bytes = max_body_bytes
        self.directory = directory or new_bridge_dir()
        self.stats = BridgeStats()
        self._http = http
        self._own_http = http is None
        self._runner: web.AppRunner | None = None

    @property
    def socket_path(self) -> str:
        return os.path.join(self.directory, SOCKET_NAME)

    async def start(self) -> str:
        """Create the directory and listen; returns the socket's path."""
        os.mkdir(self.directory, 0o755)
        os.chmod(self.directory, 0o755)  # whatever the umask
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # closing waits this long for requests under way (a process the agent left behind):
        # the episode is over, its answers go nowhere
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=CLOSE_GRACE_S)
        await self._runner.setup()
        await web.UnixSite(self._runner, self.socket_path).start()
        # a socket is connected to with write permission on it: the sandbox's uid needs it
        os.chmod(self.socket_path, 0o666)
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self.socket_path

    async def close(self) -> None:
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await self._runner.cleanup()
            self._runner = None
        if self._own_http and self._http is not None:
            await self._http.close()
            self._http = None
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)
        with contextlib.suppress(OSError):
            os.rmdir(self.directory)

    async def __aenter__(self) -> SessionBridge:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ requests

    def _refuse(self, status: int, code: str, message: str) -> web.Response:
        self.stats.refused += 1
        return web.json_response({"error": {"message": message, "type": code, "code": status}},
                                 status=status)

    def _with_sampling(self, body: bytes) -> bytes:
        """The request with the recipe's sampling in place of the agent's (a body that is not
        a JSON object goes through as it is: the session server answers it with a 4xx)."""
        if not self.sampling:
            return body
        try:
            req = json.loads(body)
        except ValueError:
            return body
        if not isinstance(req, dict):
            return body
        for k in SAMPLING_KEYS:
            if k in self.sampling:
                req[k] = self.sampling[k]
        cap = self.sampling.get("max_tokens")
        if cap:
            ask = req.pop("max_completion_tokens", None) or req.get("max_tokens")
            req["max_tokens"] = min(int(ask), int(cap)) if isinstance(ask, int) and ask > 0 \
                else int(cap)
        return json.dumps(req).encode()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.stats.requests += 1
        route = ROUTES.get((request.method, request.path))
        if route is None:
            return self._refuse(404, "not_found", f"{request.method} {request.path}: this "
                                "endpoint serves only /v1/models, /v1/chat/completions and "
                                "/v1/completions of the episode's own session")
        if not _bearer_is(request.headers.get("authorization"), self.endpoint.token):
            return self._refuse(401, "unauthorized", "missing or wrong bearer token (the "
                                "episode's OPENAI_API_KEY)")
        body = await request.read() if request.method == "POST" else b""
        if route in GENERATING:
            body = self._with_sampling(body)
        return await self._forward(request, route, body)

    async def _forward(self, request: web.Request, route: str,
                       body: bytes) -> web.StreamResponse:
        assert self._http is not None, "start() first"
        headers = {"Authorization": f"Bearer {self.endpoint.token}"}
        if body:
            headers["Content-Type"] = "application/json"
        try:
            async with asyncio.timeout(self.call_timeout_s):
                async with self._http.request(request.method, f"{self.endpoint.url}/{route}",
                                              data=body or None, headers=headers) as up:
                    self._count(route, up.status, up.reason)
                    resp = web.StreamResponse(status=up.status, headers={
                        "Content-Type": up.headers.get("Content-Type", "application/json")})
                    try:
                        await resp.prepare(request)
                        async for chunk in up.content.iter_any():
                            await resp.write(chunk)
                        await resp.write_eof()
                    except ConnectionError:  # the agent hung up: its own doing
                        pass
                    return resp
        except TimeoutError:
            why = f"{route}: no answer from the session server within {self.call_timeout_s:g}s"
            self.stats.infra.append(why)
            return web.json_response({"error": {"message": why, "type": "timeout",
                                                "code": 504}}, status=504)
        except (aiohttp.ClientError, OSError) as exc:
            why = f"{route}: session server unreachable: {type(exc).__name__}: {exc}"
            self.stats.infra.append(why)
            return web.json_response({"error": {"message": why, "type": "unavailable",
                                                "code": 502}}, status=502)

    def _count(self, route: str, status: int, reason: str | None) -> None:
        if status >= 500 or status in INFRA_STATUSES:
            self.stats.infra.append(f"{route}: session server answered {status} {reason or ''}"
                                    .rstrip())
        elif status >= 400:
            self.stats.client_errors += 1
        elif route in GENERATING:
            self.stats.model_calls += 1
