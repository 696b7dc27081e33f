"""Clients of an engine core (rl360.serve.engines.core_process): `CoreConnection`, one
connection (the replica's socket pair, or a core's channel), and `CoreChannels`, a session
shard's direct connections to the cores on its node, picked as the session-affinity router
would pick the replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from rl360.serve.engines.core_wire import (
    Cancel,
    CoreDied,
    Done,
    Failed,
    FromCore,
    Gen,
    GenDone,
    frame,
    read_frame,
)
from rl360.serve.engines.routing import rank_replicas
from rl360.types import Generation, SamplingParams

log = logging.getLogger("rl360.engine.core")


class CoreConnection:
    """One connection to an engine core: frames out, answers matched to their requests by id.
    Used by the replica over its socket pair and by session shards over the core's channel."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 gone: Callable[[], str], name: str) -> None:
        self._writer = writer
        self._gone = gone  # what to say when the core's end closes
        self._next_id = 0
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self.failure: BaseException | None = None
        self.closed = False
        self._reader = asyncio.get_running_loop().create_task(self._read(reader), name=name)
        self._reader.add_done_callback(self._on_reader_done)

    @classmethod
    async def open_unix(cls, path: str, name: str) -> CoreConnection:
        reader, writer = await asyncio.open_unix_connection(path)
        return cls(reader, writer, lambda: f"the engine core at {path} closed the channel", name)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        rid, fut = self._send(lambda i: Gen(i, list(prompt_ids), sampling))
        try:
            return await fut
        except asyncio.CancelledError:  # the caller went away: its row leaves at the next step
            if self.failure is None and not self.closed:
                self._writer.write(frame(Cancel(rid)))
            raise

    @property
    def busy(self) -> bool:
        """Whether a request on this connection waits for its answer."""
        return bool(self._waiting)

    async def request(self, make: Callable[[int], msgspec.Struct]) -> Any:
        _, fut = self._send(make)
        return await fut

    def close(self) -> None:
        """Close the connection; requests still waiting fail (the core drops their rows)."""
        self.closed = True
        self._reader.cancel()
        self._writer.close()
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(CoreDied("the connection to the engine core was closed"))
        self._waiting.clear()

    def _send(self, make: Callable[[int], msgspec.Struct]) -> tuple[int, asyncio.Future[Any]]:
        if self.failure is not None:
            raise CoreDied(f"the engine core process is gone: {self.failure}")
        self._next_id += 1
        rid = self._next_id
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        self._writer.write(frame(make(rid)))
        return rid, fut

    async def _read(self, reader: asyncio.StreamReader) -> None:
        decode = msgspec.msgpack.Decoder(FromCore).decode
        while True:
            try:
                msg = decode(await read_frame(reader))
            except (asyncio.IncompleteReadError, ConnectionError):
                raise CoreDied(self._gone()) from None
            fut = self._waiting.pop(msg.id, None)
            if fut is None or fut.done():
                continue
            if isinstance(msg, GenDone):
                fut.set_result(msg.gen)
            elif isinstance(msg, Done):
                fut.set_result(msg.value)
            elif isinstance(msg, Failed):
                fut.set_exception((ValueError if msg.kind == "value" else RuntimeError)(
                    msg.message))

    def _on_reader_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception() or CoreDied("the engine core's socket closed")
        if not self.closed:
            log.error("engine core connection: %r", exc)
        self.failure = exc
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(CoreDied(str(exc)))
        self._waiting.clear()


class CoreChannels:
    """A session shard's direct connections to the engine cores on its node. Which replica a
    session goes to is the session-affinity router's choice (rendezvous hashing of the
    session id over the replicas with an open channel, as the WeightPublisher lists them);
    when that replica's core is on this node the call goes over its channel, else (another
    node, no channel, a channel that cannot be reached) `pick` says None and the caller goes
    through Serve."""

    REFRESH_S = 2.0  # how often the table of channels is asked for again

    def __init__(self, publisher: tuple[str, str]) -> None:
        self.publisher = publisher  # (name, namespace) of the WeightPublisher actor
        self._table: dict[str, dict[str, str]] = {}
        self._at = float("-inf")
        self._refreshing: asyncio.Future[None] | None = None
        self._conns: dict[str, CoreConnection] = {}
        self._opening: dict[str, asyncio.Future[CoreConnection]] = {}
        self._node: str | None = None

    async def pick(self, route_key: str) -> tuple[str, CoreConnection] | None:
        """(replica id, connection) for the session `route_key`, or None: go through Serve."""
        if time.monotonic() - self._at > self.REFRESH_S:
            if self._refreshing is None or self._refreshing.done():
                self._refreshing = asyncio.ensure_future(self._refresh())
            await asyncio.shield(self._refreshing)
        if not self._table:
            return None
        replica = rank_replicas(route_key, list(self._table))[0]
        channel = self._table[replica]
        if channel["node"] != self._node:
            return None
        conn = self._conns.get(replica)
        if conn is not None and conn.failure is None:
            return replica, conn
        if replica not in self._opening:
            self._opening[replica] = asyncio.ensure_future(CoreConnection.open_unix(
                channel["path"], f"rl360-engine-channel-{replica[:8]}"))
        try:
            conn = await asyncio.shield(self._opening[replica])
        except OSError as e:  # the core is gone (its replica restarts) or not reachable here
            log.warning("engine channel of replica %s at %s: %r; through Serve until the "
                        "next refresh", replica, channel["path"], e)
            self._table.pop(replica, None)
            return None
        finally:
            self._opening.pop(replica, None)
        self._conns[replica] = conn
        return replica, conn

    async def _fetch(self) -> dict[str, dict[str, str]]:
        """The publisher's table of open channels ({} when it cannot be asked)."""
        import ray

        try:
            name, namespace = self.publisher
            return dict(await ray.get_actor(name, namespace=namespace).channels.remote())
        except Exception as e:  # no publisher (yet): every call goes through Serve meanwhile
            log.debug("engine channels: %r", e)
            return {}

    async def _refresh(self) -> None:
        from rl360.weights.slots import _node_id

        if self._node is None:
            self._node = _node_id()
        self._table, self._at = await self._fetch(), time.monotonic()
        # a replica no longer listed (gone, or not reported lately: a publisher that restarted
        # learns the channels again within a poll) gets no new calls; its connection closes
        # once no call waits on it, so a listing gap fails nothing under way
        for replica in [r for r in self._conns if r not in self._table]:
            if not self._conns[replica].busy:
                self._conns.pop(replica).close()

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
