"""SessionShard: a Ray actor hosting the SessionService for the sessions that hash to it."""

from __future__ import annotations

import asyncio
import json
import logging
import zlib
from typing import Any

import msgspec

from rl360.policies.chat import ChatRenderer
from rl360.policies.loading import load_tokenizer, resolve_model_path
from rl360.recipe import ModelSection, ServeSection
from rl360.serve.sessions.ledger import LedgerError
from rl360.serve.sessions.openai_types import ApiError, ChatCompletionRequest, CompletionRequest
from rl360.serve.sessions.service import EngineClient, SessionService

log = logging.getLogger("rl360.sessions")


class TurnCall(msgspec.Struct, array_like=True):
    """One session's chat turn for `SessionShard.turn` / `turns`."""

    sid: str
    token: str
    req: ChatCompletionRequest
    open_meta: dict[str, Any] | None = None  # open the session first, with this metadata
    close_final: bool = False  # a final reply closes the session and returns its samples


def shard_for(session_id: str, num_shards: int) -> int:
    return zlib.crc32(session_id.encode("utf-8", "surrogatepass")) % num_shards


def model_vocab_size(model: str) -> int:
    """The model's vocabulary from its config.json (0 when it does not say)."""
    try:
        cfg = json.loads((resolve_model_path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    for c in (cfg, cfg.get("text_config") or {}):
        if isinstance(c.get("vocab_size"), int):
            return int(c["vocab_size"])
    return 0


class SessionShard:
    def __init__(
        self,
        model: ModelSection,
        serve: ServeSection,
        model_name: str,
        engine: EngineClient,
    ) -> None:

        renderer = ChatRenderer(load_tokenizer(model.path, model.chat_template))
        self.svc = SessionService(renderer, engine, serve, max_model_len=model.max_model_len,
                                  model_name=model_name, vocab_size=model_vocab_size(model.path))
        self._reaper: asyncio.Task[None] | None = None
        self._gauges: dict[str, Any] = {}

    @classmethod
    def over(cls, svc: SessionService) -> SessionShard:
        """A shard around an existing service, without the idle reaper (in-process use)."""
        shard = cls.__new__(cls)
        shard.svc, shard._reaper, shard._gauges = svc, None, {}
        shard._reap_idle = False
        return shard

    _reap_idle = True

    def _start_reaper(self) -> None:
        if self._reaper is None and self._reap_idle:
            self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="rl360-session-reaper")
            self._reaper.add_done_callback(_log_failure)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(60.0, self.svc.config.session_ttl_s / 4))
            n = self.svc.reap_idle()
            if n:
                log.info("closed %d idle sessions", n)
            self._publish_metrics()

    def _publish_metrics(self) -> None:
        from ray.util.metrics import Gauge

        if not self._gauges:
            self._gauges["open"] = Gauge("rl360_sessions_open", "open agent sessions on this shard")
            self._gauges["events"] = Gauge(
                "rl360_session_events", "session and ledger event counts", tag_keys=("event",)
            )
        stats = self.svc.stats()
        self._gauges["open"].set(stats["open_sessions"])
        for k, v in {**self.svc.events, **stats["ledger"]}.items():
            self._gauges["events"].set(v, tags={"event": k})

    async def open(
        self, metadata: dict[str, Any], matcher: str | None, session_id: str,
        token: str | None = None,
    ) -> dict[str, str] | ApiError:
        self._start_reaper()
        try:
            return self.svc.open(metadata, matcher, session_id, token)
        except LedgerError as exc:
            return ApiError(exc.status, exc.code, exc.message)

    async def turn(
        self, sid: str, token: str, req: ChatCompletionRequest,
        open_meta: dict[str, Any] | None = None, close_final: bool = False,
    ) -> dict[str, Any]:
        """One chat turn of the built-in agent loop in one call (one Ray RPC instead of three
        for a single-turn episode). With `open_meta` the session `sid` is opened first, with
        the caller's `token`; with `close_final` a final reply (no tool calls: where the loop
        stops) closes the session and returns its samples. Answers {"opened": ... (when
        asked), "chat": the chat body or ApiError, "closed": the ledger (when closed)}."""
        return (await self.turns([TurnCall(sid, token, req, open_meta, close_final)]))[0]

    async def turns(self, calls: list[TurnCall]) -> list[dict[str, Any]]:
        """`turn` for several sessions in one call, their generations in one engine request
        (`SessionService.chat_many`): the built-in loop sends a group's first turns so. Every
        session is opened before the first await, so a close sent after this call finds it
        open. Answers in the order of `calls`."""
        outs: list[dict[str, Any]] = [{} for _ in calls]
        live: list[int] = []
        for i, c in enumerate(calls):
            if c.open_meta is not None:
                opened = outs[i]["opened"] = await self.open(c.open_meta, None, c.sid, c.token)
                if isinstance(opened, ApiError):
                    continue
            live.append(i)
        self._start_reaper()
        chats = await self.svc.chat_many([(calls[i].sid, calls[i].token, calls[i].req)
                                          for i in live])
        for i, res in zip(live, chats, strict=True):
            outs[i]["chat"] = res
            if calls[i].close_final and isinstance(res, dict) and not any(
                    c["message"].get("tool_calls") for c in res["choices"]):
                outs[i]["closed"] = await self.close(calls[i].sid, calls[i].token, False)
        return outs

    async def chat(
        self, sid: str | None, token: str | None, req: ChatCompletionRequest
    ) -> dict[str, Any] | ApiError:
        self._start_reaper()
        return await self.svc.chat(sid, token, req)

    async def complete(
        self, sid: str | None, token: str | None, req: CompletionRequest
    ) -> dict[str, Any] | ApiError:
        self._start_reaper()
        return await self.svc.complete(sid, token, req)

    async def trajectory(self, sid: str, token: str | None) -> dict[str, Any] | ApiError:
        try:
            return self.svc.trajectory(sid, token)
        except LedgerError as exc:
            return ApiError(exc.status, exc.code, exc.message)

    async def close(self, sid: str, token: str | None,
                    forest: bool = True) -> dict[str, Any] | ApiError:
        try:
            return self.svc.close(sid, token, forest)
        except LedgerError as exc:
            return ApiError(exc.status, exc.code, exc.message)

    async def stats(self) -> dict[str, Any]:
        import ray

        if ray.is_initialized():
            self._publish_metrics()
        return self.svc.stats()


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s failed: %r", task.get_name(), task.exception())
