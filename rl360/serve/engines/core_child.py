"""The engine core: the child process of a replica with `engine.core_process`
(`python -m rl360.serve.engines.core_child <socket fd>`, started by
rl360.serve.engines.core_process.CoreProcessBackend). It runs one TorchBackend on its own loop
and thread, answers the replica's connection, and serves a channel session shards connect to
once the replica opens it. It exits when the replica's end of the socket closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import tempfile
import time
from typing import Any

import msgspec

from rl360.serve.engines.core_wire import (
    Call,
    Cancel,
    Done,
    Failed,
    Gen,
    GenDone,
    Ready,
    Start,
    ToCore,
    Update,
    frame,
    load_update,
    read_frame,
)
from rl360.types import Generation
from rl360.weights.payloads import TensorUpdate

log = logging.getLogger("rl360.engine.core")


class EngineCore:
    """The core's side: one TorchBackend, the replica's connection (everything) and, once the
    replica opens it, a channel session shards connect to (generations and cancellations)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.server: asyncio.AbstractServer | None = None
        self.channel = ""  # the channel's socket path once open
        self.direct = 0  # generations that came over the channel

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    control: bool) -> None:
        """Answer one connection's requests until it closes (or, on the replica's, "close")."""
        decode = msgspec.msgpack.Decoder(ToCore).decode
        tasks: dict[int, asyncio.Task[Any]] = {}

        def reply(rid: int, task: asyncio.Task[Any]) -> None:
            tasks.pop(rid, None)
            if task.cancelled() or writer.is_closing():
                return
            exc = task.exception()
            if exc is not None:
                kind = "value" if isinstance(exc, ValueError) else "runtime"
                writer.write(frame(Failed(rid, kind, f"{type(exc).__name__}: {exc}")))
                return
            value = task.result()
            writer.write(frame(GenDone(rid, value) if isinstance(value, Generation)
                                else Done(rid, value)))

        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    msg = decode(await read_frame(reader))
                except (asyncio.IncompleteReadError, ConnectionError):  # the other end is gone
                    break
                if isinstance(msg, Cancel):
                    task = tasks.get(msg.id)
                    if task is not None:
                        task.cancel()
                    continue
                if isinstance(msg, Gen):
                    self.direct += not control
                    coro: Any = self.backend.generate(msg.prompt_ids, msg.sampling)
                elif not control:
                    writer.write(frame(Failed(getattr(msg, "id", 0), "value",
                                               "the channel takes generations only")))
                    continue
                elif isinstance(msg, Update):
                    coro = self.update(msg)
                elif isinstance(msg, Call):
                    coro = self.call(msg.what)
                else:
                    continue
                task = loop.create_task(coro, name=f"rl360-engine-core-{msg.id}")
                tasks[msg.id] = task
                task.add_done_callback(lambda t, rid=msg.id: reply(rid, t))
                if isinstance(msg, Call) and msg.what == "close":
                    await asyncio.wait({task})
                    await writer.drain()
                    break
        finally:
            for task in tasks.values():  # a shard that went away: its rows leave
                task.cancel()
            if not control:
                writer.close()

    async def update(self, msg: Update) -> bool:
        state, mm = await asyncio.to_thread(load_update, msg)
        try:
            return bool(await self.backend.update_weights(msg.version, TensorUpdate(state)))
        finally:
            del state
            with contextlib.suppress(BufferError):
                mm.close()

    async def call(self, what: str) -> Any:
        if what == "pause":
            await self.backend.pause()
        elif what == "resume":
            await self.backend.resume()
        elif what == "health":
            return {**self.backend.health(), "channel": self.channel,
                    "direct_requests": self.direct}
        elif what == "open_channel":
            return await self.open_channel()
        elif what == "close":
            await self.close()
        else:
            raise ValueError(f"engine core: unknown call {what!r}")
        return None

    async def open_channel(self) -> str:
        if self.server is None:
            # a directory only this user can enter: the socket accepts no one else
            path = os.path.join(tempfile.mkdtemp(prefix="rl360-core-"), "engine.sock")
            self.server = await asyncio.start_unix_server(
                lambda r, w: self.serve(r, w, control=False), path)
            self.channel = path
        return self.channel

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.channel:
            with contextlib.suppress(OSError):
                os.unlink(self.channel)
                os.rmdir(os.path.dirname(self.channel))
            self.channel = ""
        await self.backend.close()


async def serve_core(sock: socket.socket) -> None:
    from rl360.serve.engines.torch_backend import TorchBackend

    reader, writer = await asyncio.open_unix_connection(sock=sock)
    start = msgspec.msgpack.decode(await read_frame(reader), type=ToCore)
    if not isinstance(start, Start):
        raise RuntimeError(f"engine core: expected Start, got {type(start).__name__}")
    try:
        backend = TorchBackend(start.engine, start.model, start.seed)
    except Exception as e:
        writer.write(frame(Failed(0, "runtime", f"{type(e).__name__}: {e}")))
        await writer.drain()
        raise
    core = EngineCore(backend)
    writer.write(frame(Ready(os.getpid(), backend.health())))
    try:
        await core.serve(reader, writer, control=True)
    finally:
        await core.close()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s rl360 engine core %(levelname)s %(message)s")
    sock = socket.socket(fileno=int(args[0]))
    t0 = time.perf_counter()
    try:
        asyncio.run(serve_core(sock))
    finally:
        log.info("engine core exits after %.0f s", time.perf_counter() - t0)


if __name__ == "__main__":
    main()
