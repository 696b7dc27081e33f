"""The agent SessionServer: Serve HTTP ingress speaking the OpenAI API.

  GET  /v1/models                          POST /sessions           -> {id, token, base_url}
  POST /v1/chat/completions  (no ledger)   GET  /sessions/{id}/trajectory
  POST /v1/completions       (no ledger)   DELETE /sessions/{id}    -> final trajectory
  /sessions/{id}/v1/{models,chat/completions,completions}  recorded in the session's ledger

Session calls need `Authorization: Bearer <token>` (the OpenAI client's api_key). Replicas
are stateless: ledgers live in SessionShard actors, chosen by hashing the session id.
Malformed bodies get 400 (not JSON) or 422 (wrong shape), never a 500.
"""

# no `from __future__ import annotations` here: FastAPI must see real Request annotations
import asyncio
import json
import logging
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from rl360.serve.sessions.openai_types import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    OpenSessionRequest,
    chat_stream_chunks,
)
from rl360.serve.sessions.shard import shard_for

log = logging.getLogger("rl360.session_server")

api = FastAPI(title="RL360 session server", version="0.1")


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse(ApiError(status, code, message).body(), status_code=status)


def _decode(body: bytes, typ: type[Any]) -> Any:
    if not body:
        if typ is OpenSessionRequest:
            return OpenSessionRequest()
        raise _BadRequest(400, "invalid_json", "the request body is empty; expected JSON")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.DecodeError as exc:
        text = str(exc)
        try:
            json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise _BadRequest(400, "invalid_json", f"the body is not valid JSON: {text}") from None
        raise _BadRequest(422, "invalid_request", text.replace("`$.", "`")) from None


class _BadRequest(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


async def _sse(chunks: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    for c in chunks:
        yield b"data: " + msgspec.json.encode(c) + b"\n\n"
    yield b"data: [DONE]\n\n"


@serve.ingress(api)
class SessionServer:
    def __init__(
        self, shard_names: list[str], namespace: str, model_name: str, engine: Any = None
    ) -> None:
        import ray

        self.shards = [ray.get_actor(n, namespace=namespace) for n in shard_names]
        self.model_name = model_name
        self.engine = engine

    # -------------------------------------------------------------- plumbing

    async def _call(self, shard_idx: int, method: str, *args: Any) -> Any:
        import ray

        try:
            return await getattr(self.shards[shard_idx], method).remote(*args)
        except ray.exceptions.RayActorError as exc:
            raise _BadRequest(503, "shard_unavailable", f"session shard is down: {exc}") from None

    def _respond(self, out: Any, stream: bool = False, include_usage: bool = False) -> Response:
        if isinstance(out, ApiError):
            return JSONResponse(out.body(), status_code=out.status)
        if stream:
            return StreamingResponse(_sse(chat_stream_chunks(out, include_usage)),
                                     media_type="text/event-stream")
        return Response(msgspec.json.encode(out), media_type="application/json")

    async def _guarded(self, coro: Any) -> Response:
        try:
            return await coro
        except _BadRequest as exc:
            return _error(exc.status, exc.code, exc.message)

    # -------------------------------------------------------------- routes

    @api.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return {"ok": True, "shards": len(self.shards)}

    @api.get("/stats")
    async def stats(self) -> dict[str, Any]:
        per = await asyncio.gather(*(s.stats.remote() for s in self.shards))
        return {"shards": per}

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list",
                "data": [{"id": self.model_name, "object": "model", "owned_by": "rl360"}]}

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._guarded(self._chat(None, request))

    @api.post("/v1/completions")
    async def complete(self, request: Request) -> Response:
        return await self._guarded(self._complete(None, request))

    @api.post("/sessions")
    async def open_session(self, request: Request) -> Response:
        async def go() -> Response:
            body = _decode(await request.body(), OpenSessionRequest)
            sid = uuid.uuid4().hex
            out = await self._call(shard_for(sid, len(self.shards)), "open", body.metadata,
                                   body.matcher, sid)
            if isinstance(out, ApiError):
                return self._respond(out)
            out["base_url"] = f"/sessions/{sid}/v1"
            return JSONResponse(out, status_code=201)

        return await self._guarded(go())

    @api.get("/sessions/{sid}/v1/models")
    async def session_models(self, sid: str) -> dict[str, Any]:
        return await self.models()

    @api.post("/sessions/{sid}/v1/chat/completions")
    async def session_chat(self, sid: str, request: Request) -> Response:
        return await self._guarded(self._chat(sid, request))

    @api.post("/sessions/{sid}/v1/completions")
    async def session_complete(self, sid: str, request: Request) -> Response:
        return await self._guarded(self._complete(sid, request))

    @api.get("/sessions/{sid}/trajectory")
    async def trajectory(self, sid: str, request: Request) -> Response:
        out = await self._guarded_call(sid, "trajectory", _bearer(request))
        return out if isinstance(out, Response) else self._respond(out)

    @api.delete("/sessions/{sid}")
    async def close_session(self, sid: str, request: Request) -> Response:
        out = await self._guarded_call(sid, "close", _bearer(request))
        return out if isinstance(out, Response) else self._respond(out)

    async def _guarded_call(self, sid: str, method: str, *args: Any) -> Any:
        try:
            return await self._call(shard_for(sid, len(self.shards)), method, sid, *args)
        except _BadRequest as exc:
            return _error(exc.status, exc.code, exc.message)

    async def _chat(self, sid: str | None, request: Request) -> Response:
        req = _decode(await request.body(), ChatCompletionRequest)
        idx = shard_for(sid, len(self.shards)) if sid else random.randrange(len(self.shards))
        token = _bearer(request) if sid else None
        out = await self._call(idx, "chat", sid, token, req)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return self._respond(out, stream=req.stream, include_usage=include_usage)

    async def _complete(self, sid: str | None, request: Request) -> Response:
        req = _decode(await request.body(), CompletionRequest)
        if req.stream:
            raise _BadRequest(400, "unsupported", "stream=true is supported on chat completions only")
        idx = shard_for(sid, len(self.shards)) if sid else random.randrange(len(self.shards))
        token = _bearer(request) if sid else None
        return self._respond(await self._call(idx, "complete", sid, token, req))
