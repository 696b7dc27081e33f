"""ChatClient implementations over the session server's ledger.

RL360's own agent loop talks to the SessionShard actors directly (no HTTP hop); an agent
function gets an OpenAI client pointed at the session's HTTP endpoint. Both write the same
ledger, so the trajectory's tokens always come from the engine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec

from rl360.envs.agent import ChatTurn, InfraError
from rl360.serve.sessions.openai_types import ApiError, ChatCompletionRequest, ChatMessageIn
from rl360.serve.sessions.shard import shard_for
from rl360.types import FunctionCall, Message, ToolCall, ToolSpec


class SessionDirectory:
    """The SessionShard actors of a running app; finds the shard hosting a session."""

    def __init__(self, shard_names: list[str], namespace: str) -> None:
        self.shard_names = list(shard_names)
        self.namespace = namespace
        self._handles: list[Any] | None = None

    def shard(self, session_id: str) -> Any:
        if self._handles is None:
            import ray

            self._handles = [ray.get_actor(n, namespace=self.namespace) for n in self.shard_names]
        return self._handles[shard_for(session_id, len(self._handles))]


class ShardChatClient:
    """A ChatClient for one session, calling its shard actor.

    `open_meta`: the session is not open yet; the first chat opens it (with this metadata and
    the caller's `token`) in the same call. `close_final`: a final reply (no tool calls, where
    the built-in loop stops) closes the session in the same call, and its samples are kept in
    `closed`. Both through `SessionShard.turn`: a single-turn episode costs one RPC to its
    shard instead of three (open, chat, close)."""

    def __init__(self, shard: Any, session_id: str, token: str, sampling: dict[str, Any],
                 open_meta: dict[str, Any] | None = None, close_final: bool = False) -> None:
        self.shard = shard
        self.session_id = session_id
        self.token = token
        self.sampling = dict(sampling)
        self.open_meta = open_meta
        self.close_final = close_final
        self.closed: dict[str, Any] | None = None

    async def _call(self, req: ChatCompletionRequest) -> Any:
        if self.open_meta is None and not self.close_final:
            return await _cancellable(self.shard.chat.remote(self.session_id, self.token, req))
        def call() -> Any:
            return self.shard.turn.remote(self.session_id, self.token, req, self.open_meta,
                                          self.close_final)

        # a first turn opens the session, so it may be retried while the shard restarts; a
        # chat on an open session is not
        out = await (until_shard_answers(call) if self.open_meta is not None
                     else _cancellable(call()))
        if "opened" in out:
            if isinstance(out["opened"], ApiError):
                raise InfraError(f"could not open a session: {out['opened']}")
            self.open_meta = None
        if out.get("closed") is not None:
            self.closed = out["closed"]
        return out["chat"]

    async def chat(self, messages: list[Message], tools: list[ToolSpec]) -> ChatTurn:
        req = ChatCompletionRequest(
            messages=[msgspec.convert(msgspec.to_builtins(m), ChatMessageIn) for m in messages],
            tools=list(tools) or None,
            **self.sampling,
        )
        out = await self._call(req)
        if isinstance(out, ApiError) and out.code == "context_length":
            # the conversation outgrew the context: the model's episode is cut, not broken
            return ChatTurn(message=Message(role="assistant", content=""), finish_reason="length")
        if isinstance(out, ApiError):
            raise InfraError(f"session server answered {out.status} {out.code}: {out.message}")
        choice = out["choices"][0]
        msg = choice["message"]
        calls = [
            ToolCall(
                id=tc["id"],
                function=FunctionCall(tc["function"]["name"], tc["function"]["arguments"]),
            )
            for tc in msg.get("tool_calls") or []
        ]
        return ChatTurn(
            message=Message(role="assistant", content=msg.get("content"), tool_calls=calls or None),
            finish_reason=choice["finish_reason"],
            malformed_tool_calls=int(out.get("rl360", {}).get("malformed_tool_calls", 0)),
            timings={f"server_{k}": float(v)
                     for k, v in out.get("rl360", {}).get("timings", {}).items()},
        )


async def until_shard_answers(call: Callable[[], Any]) -> Any:
    """Await `call()` (a shard actor call's ref), calling again while the shard restarts: a
    restarting actor refuses calls at once, before running them, so this is safe for a call
    whose session did not exist yet (an open). The caller bounds the wait."""
    import ray

    delay = 0.2
    while True:
        try:
            return await _cancellable(call())
        except ray.exceptions.ActorUnavailableError:
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)


async def _cancellable(ref: Any) -> Any:
    """Await a shard call; when the episode is cancelled, cancel the shard's call too (its
    asyncio task then cancels the engine request)."""
    try:
        return await ref
    except asyncio.CancelledError:
        import ray

        ray.cancel(ref)
        raise
