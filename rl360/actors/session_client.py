"""ChatClient implementations over the session server's ledger.

RL360's own agent loop talks to the SessionShard actors directly (no HTTP hop); an agent
function gets an OpenAI client pointed at the session's HTTP endpoint. Both write the same
ledger, so the trajectory's tokens always come from the engine."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from rl360.envs.agent import ChatTurn, InfraError
from rl360.serve.sessions.openai_types import ApiError, ChatCompletionRequest, ChatMessageIn
from rl360.serve.sessions.shard import TurnCall, shard_for
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

    def session_id(self, like: str | None = None) -> str:
        """A new session id; with `like`, one on the same shard as that session (a group's
        sessions share a shard, so their first turns go there in one call)."""
        while True:
            sid = uuid.uuid4().hex
            if like is None or (shard_for(sid, len(self.shard_names))
                                == shard_for(like, len(self.shard_names))):
                return sid


class FirstTurns:
    """Gathers the first chat turns of a group's episodes into one `SessionShard.turns` call
    per shard: one Ray RPC, one engine request and one prompt prefix for the group instead of
    one each per episode (a group's sessions share a shard: `SessionDirectory.session_id`).

    A batch goes when every member still running has sent its first turn, or `wait_s` after
    the first one arrived (a member whose setup is slow joins a later batch). A member that
    ends without sending one calls `leave`. A member cancelled before its batch goes is taken
    out of it; one cancelled while its batch is in flight leaves it running for the others
    (the call opens its session; the member's own clean-up, sent later to the same shard,
    closes it); when every member of a batch is cancelled, the shard's call is cancelled."""

    def __init__(self, members: int, wait_s: float = 0.25) -> None:
        self.expected = members  # members whose first turn has not arrived yet
        self.like: str | None = None  # the first member's session id (the others' shard)
        self.wait_s = wait_s
        self._pending: list[tuple[Any, TurnCall, asyncio.Future[dict[str, Any]]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def leave(self) -> None:
        """A member that ended without sending a first turn."""
        self.expected -= 1
        if self.expected <= 0:
            self._flush()

    async def turn(self, shard: Any, call: TurnCall) -> dict[str, Any]:
        """`SessionShard.turn`'s answer for `call`, sent to `shard` with its siblings'."""
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending.append((shard, call, fut))
        self.expected -= 1
        if self.expected <= 0:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.wait_s, self._flush)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self._pending = [p for p in self._pending if p[2] is not fut]  # if not sent yet
            fut.cancel()
            raise

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        by_shard: dict[int, list[tuple[Any, TurnCall, asyncio.Future[Any]]]] = {}
        for p in self._pending:
            by_shard.setdefault(id(p[0]), []).append(p)
        self._pending = []
        for batch in by_shard.values():
            task = asyncio.get_running_loop().create_task(self._send(batch),
                                                          name="rl360-first-turns")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[Any, TurnCall, asyncio.Future[Any]]]) -> None:
        shard, calls, futs = batch[0][0], [p[1] for p in batch], [p[2] for p in batch]
        call = asyncio.ensure_future(until_shard_answers(lambda: shard.turns.remote(calls)))

        def all_cancelled(_: Any) -> None:
            if all(f.cancelled() for f in futs):
                call.cancel()  # until_shard_answers cancels the shard's call

        for f in futs:
            f.add_done_callback(all_cancelled)
        try:
            outs = await call
        except asyncio.CancelledError:
            for f in futs:
                f.cancel()
            if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise  # this task itself was cancelled (the actor is going away)
            return
        except Exception as exc:  # every member sees the failure as its own
            for f in futs:
                if not f.done():
                    f.set_exception(exc)
            return
        for f, out in zip(futs, outs, strict=True):
            if not f.done():
                f.set_result(out)


class ShardChatClient:
    """A ChatClient for one session, calling its shard actor.

    `open_meta`: the session is not open yet; the first chat opens it (with this metadata and
    the caller's `token`) in the same call. `close_final`: a final reply (no tool calls, where
    the built-in loop stops) closes the session in the same call, and its samples are kept in
    `closed`. Both through `SessionShard.turn`: a single-turn episode costs one RPC to its
    shard instead of three (open, chat, close)."""

    def __init__(self, shard: Any, session_id: str, token: str, sampling: dict[str, Any],
                 open_meta: dict[str, Any] | None = None, close_final: bool = False,
                 first_turns: FirstTurns | None = None) -> None:
        """`first_turns`: the group's batcher, which sends this session's first turn (the
        one that opens it) together with its siblings'."""
        self.shard = shard
        self.first_turns = first_turns
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
        if self.open_meta is not None and self.first_turns is not None:
            batcher, self.first_turns = self.first_turns, None
            out = await batcher.turn(self.shard, TurnCall(self.session_id, self.token, req,
                                                          self.open_meta, self.close_final))
        elif self.open_meta is not None:
            out = await until_shard_answers(call)
        else:
            out = await _cancellable(call())
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
