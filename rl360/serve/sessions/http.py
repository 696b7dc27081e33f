"""The agent SessionServer: Serve HTTP ingress speaking the OpenAI API.

  GET  /v1/models                          POST /sessions           -> {id, token, base_url}
  POST /v1/chat/completions  (no ledger)   GET  /sessions/{id}/trajectory
  POST /v1/completions       (no ledger)   DELETE /sessions/{id}    -> final trajectory
  /sessions/{id}/v1/{models,chat/completions,completions}  recorded in the session's ledger

Session calls need `Authorization: Bearer <token>` (the OpenAI client's api_key). Opening a
session, the sessionless /v1/* and /stats need the server key (`serve.api_key`) when one is
set, and one must be set when `serve.host` is not loopback. Replicas are stateless: ledgers
live in SessionShard actors, chosen by hashing the session id.

Bad input never gets a 5xx: bodies over `serve.max_body_bytes` get 413, invalid or too deeply
nested JSON 400, a wrong shape 422, a bad or missing credential 401; a shard that is down
gives 503 with Retry-After; anything unexpected is one JSON error without a traceback.
`Gateway` holds the logic and `build_app` its routes, so tests run it in-process with local
shards (`LocalShards`); `SessionServer` is the Serve deployment around it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import msgspec
import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.requests import ClientDisconnect

from rl360.recipe import ServeSection
from rl360.serve.sessions.auth import bearer, resolve_api_key, same_secret
from rl360.serve.sessions.openai_types import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    OpenSessionRequest,
    chat_stream_chunks,
)
from rl360.serve.sessions.shard import shard_for

log = logging.getLogger("rl360.session_server")

RETRY_AFTER_S = "5"
# the longest a request waits on its session shard (a chat call includes the generation); a
# shard that takes longer is stuck, and the client gets a 504 instead of a request that hangs
SHARD_REQUEST_TIMEOUT_S = 900.0
# Serve's own end-to-end bound on an HTTP request (its proxies answer 408 past it): later than
# the 504 above, so it only ends requests a session-server replica itself never answers
HTTP_REQUEST_TIMEOUT_S = SHARD_REQUEST_TIMEOUT_S + 60.0


class HttpError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def error_response(status: int, code: str, message: str) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_S} if status in (429, 503) else None
    return JSONResponse(ApiError(status, code, message).body(), status_code=status,
                        headers=headers)


# ---------------------------------------------------------------------- shards


class ShardCaller(Protocol):
    """How the gateway reaches the K session shards; raises HttpError(503) if one is down."""

    count: int

    async def call(self, idx: int, method: str, *args: Any) -> Any: ...


class RayShards:
    def __init__(self, shard_names: list[str], namespace: str) -> None:
        self.handles = [ray.get_actor(n, namespace=namespace) for n in shard_names]
        self.count = len(self.handles)

    async def call(self, idx: int, method: str, *args: Any) -> Any:
        ref = getattr(self.handles[idx], method).remote(*args)
        try:
            return await asyncio.wait_for(ref, SHARD_REQUEST_TIMEOUT_S)
        except TimeoutError:
            ray.cancel(ref)
            raise HttpError(504, "shard_timeout", f"session shard {idx} did not answer within "
                            f"{SHARD_REQUEST_TIMEOUT_S:g}s (SHARD_REQUEST_TIMEOUT_S)") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.ObjectLostError) as exc:
            log.warning("session shard %d unavailable: %s", idx, type(exc).__name__)
            raise HttpError(503, "shard_unavailable", "a session shard is down; retry "
                            "later (sessions on it are lost if it restarted)") from None


class LocalShards:
    """In-process shards (tests, single-process use): objects with SessionShard's methods.
    `down` marks shard indexes that answer like a dead actor."""

    def __init__(self, shards: list[Any]) -> None:
        self.shards = shards
        self.count = len(shards)
        self.down: set[int] = set()

    async def call(self, idx: int, method: str, *args: Any) -> Any:
        if idx in self.down:
            raise HttpError(503, "shard_unavailable", "a session shard is down; retry later")
        return await getattr(self.shards[idx], method)(*args)


# ---------------------------------------------------------------------- request bodies


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise HttpError(413, "body_too_large", f"the body exceeds {limit} bytes "
                                "(serve.max_body_bytes)")
        except ValueError:
            raise HttpError(400, "bad_content_length", "Content-Length is not a number") from None
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HttpError(413, "body_too_large", f"the body exceeds {limit} bytes "
                                "(serve.max_body_bytes)")
            chunks.append(chunk)
    except ClientDisconnect:
        raise HttpError(400, "client_disconnected", "the client left before sending the "
                        "whole body") from None
    return b"".join(chunks)


def json_depth(obj: Any, limit: int) -> bool:
    """Whether `obj` (decoded JSON) nests at most `limit` levels (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            o = list(o.values())
        if isinstance(o, list):
            if d > limit:
                return False
            stack.extend((x, d + 1) for x in o if isinstance(x, dict | list))
    return True


def decode(body: bytes, typ: type[Any], max_depth: int) -> Any:
    if not body:
        if typ is OpenSessionRequest:
            return OpenSessionRequest()
        raise HttpError(400, "invalid_json", "the request body is empty; expected JSON")
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise HttpError(400, "invalid_json", f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise HttpError(400, "too_deep", f"the JSON nests deeper than {max_depth} levels") from None
    if not json_depth(raw, max_depth):
        raise HttpError(400, "too_deep", f"the JSON nests deeper than {max_depth} levels "
                        "(serve.max_json_depth)")
    try:
        return msgspec.json.decode(body, type=typ)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise HttpError(422, "invalid_request", str(exc).replace("`$.", "`")) from None


async def _sse(chunks: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    for c in chunks:
        yield b"data: " + msgspec.json.encode(c) + b"\n\n"
    yield b"data: [DONE]\n\n"


def respond(out: Any, stream: bool = False, include_usage: bool = False) -> Response:
    if isinstance(out, ApiError):
        return error_response(out.status, out.code, out.message)
    if stream:
        return StreamingResponse(_sse(chat_stream_chunks(out, include_usage)),
                                 media_type="text/event-stream")
    return Response(msgspec.json.encode(out), media_type="application/json")


# ---------------------------------------------------------------------- the gateway


class Gateway:
    """The routes' logic over a ShardCaller; one per server replica."""

    def __init__(self, shards: ShardCaller, serve_cfg: ServeSection, model_name: str) -> None:
        self.shards = shards
        self.cfg = serve_cfg
        self.model_name = model_name
        self.api_key = resolve_api_key(serve_cfg.host, serve_cfg.api_key)

    def _server_auth(self, request: Request) -> None:
        if self.api_key and not same_secret(bearer(request.headers.get("authorization")),
                                            self.api_key):
            raise HttpError(401, "unauthorized", "missing or wrong server API key "
                            "(Authorization: Bearer <serve.api_key>)")

    def _token(self, request: Request) -> str:
        token = bearer(request.headers.get("authorization"))
        if token is None:
            raise HttpError(401, "unauthorized", "missing or malformed bearer token for this "
                            "session (Authorization: Bearer <token>)")
        return token

    def _idx(self, sid: str | None) -> int:
        return shard_for(sid, self.shards.count) if sid else random.randrange(self.shards.count)

    async def body(self, request: Request, typ: type[Any]) -> Any:
        return decode(await read_body(request, self.cfg.max_body_bytes), typ,
                      self.cfg.max_json_depth)

    async def stats(self, request: Request) -> Response:
        self._server_auth(request)
        per = await asyncio.gather(*(self.shards.call(i, "stats") for i in range(self.shards.count)),
                                   return_exceptions=True)
        down = [i for i, p in enumerate(per) if isinstance(p, BaseException)]
        if down:
            raise HttpError(503, "shard_unavailable", f"session shards {down} are down")
        return JSONResponse({"shards": per})

    async def models(self, request: Request, sid: str | None) -> Response:
        if sid is None:
            self._server_auth(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": "rl360"}]})

    async def open_session(self, request: Request) -> Response:
        self._server_auth(request)
        body = await self.body(request, OpenSessionRequest)
        sid = uuid.uuid4().hex
        out = await self.shards.call(self._idx(sid), "open", body.metadata, body.matcher, sid)
        if isinstance(out, ApiError):
            return respond(out)
        out["base_url"] = f"/sessions/{sid}/v1"
        return JSONResponse(out, status_code=201)

    async def chat(self, request: Request, sid: str | None) -> Response:
        token = self._token(request) if sid else None
        if sid is None:
            self._server_auth(request)
        req = await self.body(request, ChatCompletionRequest)
        if len(req.messages) > self.cfg.max_messages:
            raise HttpError(400, "too_many_messages", f"{len(req.messages)} messages; at most "
                            f"{self.cfg.max_messages} (serve.max_messages)")
        out = await self.shards.call(self._idx(sid), "chat", sid, token, req)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return respond(out, stream=req.stream, include_usage=include_usage)

    async def complete(self, request: Request, sid: str | None) -> Response:
        token = self._token(request) if sid else None
        if sid is None:
            self._server_auth(request)
        req = await self.body(request, CompletionRequest)
        if req.stream:
            raise HttpError(400, "unsupported", "stream=true is supported on chat completions only")
        return respond(await self.shards.call(self._idx(sid), "complete", sid, token, req))

    async def session_call(self, request: Request, sid: str, method: str) -> Response:
        token = self._token(request)
        return respond(await self.shards.call(self._idx(sid), method, sid, token))


def build_app(gateway: Gateway) -> FastAPI:
    api = FastAPI(title="RL360 session server", version="0.2", openapi_url=None,
                  docs_url=None, redoc_url=None)

    def route(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
        async def wrapped(*args: Any, **kwargs: Any) -> Response:
            try:
                return await handler(*args, **kwargs)
            except HttpError as exc:
                return error_response(exc.status, exc.code, exc.message)

        return wrapped

    @api.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True}

    @api.get("/stats")
    async def stats(request: Request) -> Response:
        return await route(gateway.stats)(request)

    @api.get("/v1/models")
    async def models(request: Request) -> Response:
        return await route(gateway.models)(request, None)

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await route(gateway.chat)(request, None)

    @api.post("/v1/completions")
    async def complete(request: Request) -> Response:
        return await route(gateway.complete)(request, None)

    @api.post("/sessions")
    async def open_session(request: Request) -> Response:
        return await route(gateway.open_session)(request)

    @api.get("/sessions/{sid}/v1/models")
    async def session_models(sid: str, request: Request) -> Response:
        return await route(gateway.models)(request, sid)

    @api.post("/sessions/{sid}/v1/chat/completions")
    async def session_chat(sid: str, request: Request) -> Response:
        return await route(gateway.chat)(request, sid)

    @api.post("/sessions/{sid}/v1/completions")
    async def session_complete(sid: str, request: Request) -> Response:
        return await route(gateway.complete)(request, sid)

    @api.get("/sessions/{sid}/trajectory")
    async def trajectory(sid: str, request: Request) -> Response:
        return await route(gateway.session_call)(request, sid, "trajectory")

    @api.delete("/sessions/{sid}")
    async def close_session(sid: str, request: Request) -> Response:
        return await route(gateway.session_call)(request, sid, "close")

    async def unexpected(request: Request, exc: Exception) -> Response:
        return error_response(500, "internal_error", "the server failed on this request; it "
                              "was logged")

    api.add_exception_handler(Exception, unexpected)
    return CatchAll(api)  # type: ignore[return-value]


class CatchAll:
    """ASGI wrapper: anything a route did not turn into an answer becomes one JSON error with
    no traceback (logged here, with it); a disconnect mid-response is not an error."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                return  # the client already has a status line; nothing more to say
            body = json.dumps(ApiError(500, "internal_error", "the server failed on this "
                                       "request; it was logged").body()).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


@serve.ingress()
class SessionServer:
    """The Serve deployment: one Gateway over the shard actors per replica."""

    def __init__(self, shard_names: list[str], namespace: str, model_name: str,
                 serve_cfg: ServeSection, engine: Any = None) -> None:
        self.gateway = Gateway(RayShards(shard_names, namespace), serve_cfg, model_name)
        self.engine = engine

    def __serve_build_asgi_app__(self) -> Any:
        return build_app(self.gateway)
