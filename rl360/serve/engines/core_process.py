"""The torch engine in a process of its own (`engine.core_process = true`).

A Serve replica's process runs Serve's request handling (gRPC, request wrapping, metrics) on
its asyncio loop; with the torch engine in the same process its decode steps share one GIL with
that loop (docs/sessions.md: a decode step 12-25% slower in a replica than in
process). `CoreProcessBackend` keeps the replica's side
to forwarding: it starts `python -m rl360.serve.engines.core_process` (the engine core: a
`TorchBackend` on its own loop and thread) and talks to it over a Unix socket pair in
length-prefixed msgpack frames, as vLLM's front end talks to its EngineCore.

What crosses the socket: requests (prompt ids + sampling) and their generations, cancellations
(a cancelled caller's row leaves at the core's next step), pause / resume, health, and weight
versions. A version's tensors do not go through the socket: the replica writes them into one
shared-memory buffer (a memfd it keeps and reuses) and sends their layout; the core maps the
buffer read-only through /proc/<replica pid>/fd/<fd> and copies them into its parameters. That
is one copy more than a torch engine serving a weight slot in place (docs/weight-sync.md):
the core loads every version by copy, as `zero_copy = false` does.

Once the replica serves the published weights it opens a channel to the core (a Unix socket in
a directory only this user can enter; `_Core.open_channel`): session shards on the node send a
session's generations straight to it (`CoreChannels`, the replica the affinity router would
pick), with no Serve router, gRPC channel or replica process on the way.

The core exits when the socket closes: the replica closed it, or its process ended and the
kernel closed it (the core's loop reads the socket apart from its engine thread, so it notices
within a decode step; not PR_SET_PDEATHSIG, which fires when the *thread* that started the
core exits, and Serve may build a replica on a worker thread). A core that dies fails every waiting request with the reason
and makes `health()["ok"]` false, so Serve's health check replaces the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec

from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.base import check_prompt
from rl360.serve.engines.routing import rank_replicas
from rl360.types import Generation, SamplingParams
from rl360.weights.payloads import TensorUpdate, WeightUpdate, refuse
from rl360.weights.plan import update_checksums
from rl360.weights.receiver import Intake, WeightChecksums

log = logging.getLogger("rl360.engine.core")

START_TIMEOUT_S = 600.0  # the core's import + model load (a large checkpoint on a slow disk)
HEALTH_EVERY_S = 1.0  # how often the replica refreshes the core's health figures
_LEN = struct.Struct("<I")


# ----------------------------------------------------------------------------- wire types


class Start(msgspec.Struct, tag=True):
    engine: EngineSection
    model: ModelSection
    seed: int


class Gen(msgspec.Struct, tag=True):
    id: int
    prompt_ids: list[int]
    sampling: SamplingParams


class Cancel(msgspec.Struct, tag=True):
    id: int


class Call(msgspec.Struct, tag=True):
    """pause / resume / health / close, answered with Done."""

    id: int
    what: str


class Entry(msgspec.Struct, array_like=True):
    name: str
    dtype: str  # torch dtype name without "torch."
    shape: list[int]
    offset: int
    nbytes: int


class Update(msgspec.Struct, tag=True):
    id: int
    version: int
    pid: int  # the replica's process: the buffer is /proc/<pid>/fd/<fd>
    fd: int
    entries: list[Entry]


class Ready(msgspec.Struct, tag=True):
    pid: int
    health: dict[str, Any]


class GenDone(msgspec.Struct, tag=True):
    id: int
    gen: Generation


class Done(msgspec.Struct, tag=True):
    id: int
    value: Any = None


class Failed(msgspec.Struct, tag=True):
    id: int
    kind: str  # "value" (bad input) or "runtime"
    message: str


ToCore = Start | Gen | Cancel | Call | Update
FromCore = Ready | GenDone | Done | Failed

_encode = msgspec.msgpack.Encoder().encode


def _frame(msg: msgspec.Struct) -> bytes:
    body = _encode(msg)
    return _LEN.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    return await reader.readexactly(n)


class CoreDied(RuntimeError):
    pass


# ----------------------------------------------------------------------------- client side


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
                self._writer.write(_frame(Cancel(rid)))
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
        self._writer.write(_frame(make(rid)))
        return rid, fut

    async def _read(self, reader: asyncio.StreamReader) -> None:
        decode = msgspec.msgpack.Decoder(FromCore).decode
        while True:
            try:
                msg = decode(await _read_frame(reader))
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


# ----------------------------------------------------------------------------- replica side


class CoreProcessBackend:
    """EngineBackend that forwards to a torch engine core in a child process."""

    def __init__(self, engine: EngineSection, model_cfg: ModelSection, seed: int = 0) -> None:
        if engine.backend != "torch":
            raise ValueError(f"engine.core_process runs the torch backend only, not {engine.backend!r}")
        self.engine_cfg, self.model_cfg = engine, model_cfg
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        # the core imports rl360 as this process does (a job's working_dir, py_modules)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "rl360.serve.engines.core_process", str(child.fileno())],
            pass_fds=[child.fileno()], env=env, close_fds=True)
        child.close()
        self._version = 0
        self._health: dict[str, Any] = {}
        self._conn: CoreConnection | None = None
        self._connecting: asyncio.Future[CoreConnection] | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._buffer: _StagingBuffer | None = None
        self._closed = False
        self.node = ""  # the node the core runs on (Ray's node id), for session shards
        try:
            self._sock.settimeout(START_TIMEOUT_S)
            self._sock.sendall(_frame(Start(engine, model_cfg, seed)))
            ready = msgspec.msgpack.decode(_recv_frame_blocking(self._sock), type=FromCore)
        except (OSError, EOFError, msgspec.DecodeError) as e:
            self._kill()
            raise RuntimeError(f"the engine core process did not start (exit code "
                               f"{self._proc.poll()}): {e!r}; its log is the replica's") from e
        if isinstance(ready, Failed):
            self._kill()
            raise RuntimeError(f"the engine core process failed to start: {ready.message}")
        assert isinstance(ready, Ready)
        self._health = ready.health
        self._sock.settimeout(None)
        self._sock.setblocking(False)
        self.core_pid = ready.pid

    # ------------------------------------------------------------------ contract

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        check_prompt(prompt_ids, self.model_cfg.max_model_len)
        return await (await self._connection()).generate(prompt_ids, sampling)

    def weight_intake(self) -> Intake:
        return Intake()  # versions as tensors, staged for the core to copy

    async def update_weights(self, version: int, update: WeightUpdate) -> bool:
        if not isinstance(update, TensorUpdate):
            raise refuse("core process", update, "tensor (name -> tensor)")
        conn = await self._connection()
        if self._buffer is None:
            self._buffer = _StagingBuffer()
        buffer = self._buffer
        entries = await asyncio.to_thread(buffer.stage, update.tensors)
        ok = bool(await conn.request(lambda i: Update(i, version, os.getpid(), buffer.fd,
                                                      entries)))
        if ok:
            self._version = max(self._version, version)
        return ok

    async def weight_checksums(self, names: list[str], update: WeightUpdate) -> WeightChecksums:
        return await asyncio.to_thread(update_checksums, names, update)

    async def pause(self) -> None:
        await self._call("pause")

    async def resume(self) -> None:
        await self._call("resume")

    async def open_channel(self) -> str:
        """Let session shards on this node send generations straight to the core (a Unix
        socket in a directory only this user can enter); its path, also in `health()`. The
        replica opens it once it serves the published weights."""
        path = str(await self._call("open_channel"))
        if not self.node:
            from rl360.weights.slots import _node_id

            self.node = _node_id()
        await self.refresh_health()
        return path

    def health(self) -> dict[str, Any]:
        """The core's health as of its last report (refreshed every HEALTH_EVERY_S while the
        replica serves), with the core's pid and node; not ok once the core has died."""
        out = {**self._health, "core_process": True, "core_pid": self.core_pid,
               "core_node": self.node}
        failure = self._conn.failure if self._conn is not None else None
        if failure is not None:
            out |= {"ok": False, "error": repr(failure)}
        return out

    async def refresh_health(self) -> dict[str, Any]:
        """Ask the core for its health now (what `health()` then returns)."""
        self._health = dict(await self._call("health"))
        self._version = max(self._version, int(self._health.get("version", 0)))
        return self.health()

    async def close(self) -> None:
        if self._closed:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._call("close"), 10.0)
        self._closed = True
        if self._health_task is not None:
            self._health_task.cancel()
        if self._conn is not None:
            self._conn.close()
        self._kill()
        if self._buffer is not None:
            self._buffer.close()

    # ------------------------------------------------------------------ the socket

    async def _connection(self) -> CoreConnection:
        if self._conn is not None:
            return self._conn
        if self._connecting is None:  # one connection: concurrent first callers share it
            self._connecting = asyncio.ensure_future(self._connect())
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> CoreConnection:
        reader, writer = await asyncio.open_unix_connection(sock=self._sock)

        def gone() -> str:
            code = self._proc.poll()
            return (f"the engine core process (pid {self._proc.pid}) exited"
                    + (f" with code {code}" if code is not None else ""))

        self._conn = CoreConnection(reader, writer, gone, "rl360-engine-core-reader")
        self._health_task = asyncio.get_running_loop().create_task(
            self._refresh_health(), name="rl360-engine-core-health")
        return self._conn

    async def _call(self, what: str) -> Any:
        return await (await self._connection()).request(lambda i: Call(i, what))

    async def _refresh_health(self) -> None:
        while not self._closed and (self._conn is None or self._conn.failure is None):
            with contextlib.suppress(CoreDied, RuntimeError):
                await self.refresh_health()
            await asyncio.sleep(HEALTH_EVERY_S)

    def _kill(self) -> None:
        """Stop our own child (by its pid, never by name)."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        with contextlib.suppress(OSError):
            self._sock.close()


def _recv_frame_blocking(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("the engine core process closed its socket")
            buf += chunk
        return bytes(buf)

    (n,) = _LEN.unpack(exactly(_LEN.size))
    return exactly(n)


class _StagingBuffer:
    """The replica's shared-memory buffer a weight version is written into for the core (a
    memfd, grown when a version needs more, reused version after version: updates are
    serial, the core has copied a version out before it answers)."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("rl360-engine-core-weights", os.MFD_CLOEXEC)
        self.size = 0
        self.mm: mmap.mmap | None = None

    def stage(self, state: dict[str, Any]) -> list[Entry]:
        import numpy as np
        import torch

        from rl360.weights.slots import slot_offsets

        tensors = {k: torch.as_tensor(v) for k, v in state.items()}
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        offsets, at = slot_offsets(sizes)  # aligned as in a weight slot
        entries = [Entry(name, str(t.dtype).removeprefix("torch."), list(t.shape), off, n)
                   for (name, t), off, n in zip(tensors.items(), offsets, sizes, strict=True)]
        if at > self.size:
            if self.mm is not None:
                self.mm.close()
            os.ftruncate(self.fd, at)
            self.size = at
            self.mm = mmap.mmap(self.fd, at)
        assert self.mm is not None
        for e, t in zip(entries, tensors.values(), strict=True):
            if e.nbytes:
                dst = np.frombuffer(self.mm, np.uint8, e.nbytes, e.offset)
                np.copyto(dst, t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        return entries

    def close(self) -> None:
        if self.mm is not None:
            with contextlib.suppress(BufferError):
                self.mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


# ----------------------------------------------------------------------------- core side


def _load_update(msg: Update) -> tuple[dict[str, Any], mmap.mmap]:
    import numpy as np
    import torch

    with open(f"/proc/{msg.pid}/fd/{msg.fd}", "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    state = {}
    for e in msg.entries:
        raw = np.frombuffer(mm, np.uint8, e.nbytes, e.offset)
        t = torch.frombuffer(raw, dtype=torch.uint8) if e.nbytes else torch.empty(0, dtype=torch.uint8)
        state[e.name] = t.view(getattr(torch, e.dtype)).reshape(e.shape)
    return state, mm


class _Core:
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
                writer.write(_frame(Failed(rid, kind, f"{type(exc).__name__}: {exc}")))
                return
            value = task.result()
            writer.write(_frame(GenDone(rid, value) if isinstance(value, Generation)
                                else Done(rid, value)))

        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    msg = decode(await _read_frame(reader))
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
                    writer.write(_frame(Failed(getattr(msg, "id", 0), "value",
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
        state, mm = await asyncio.to_thread(_load_update, msg)
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


async def _serve(sock: socket.socket) -> None:
    from rl360.serve.engines.torch_backend import TorchBackend

    reader, writer = await asyncio.open_unix_connection(sock=sock)
    start = msgspec.msgpack.decode(await _read_frame(reader), type=ToCore)
    if not isinstance(start, Start):
        raise RuntimeError(f"engine core: expected Start, got {type(start).__name__}")
    try:
        backend = TorchBackend(start.engine, start.model, start.seed)
    except Exception as e:
        writer.write(_frame(Failed(0, "runtime", f"{type(e).__name__}: {e}")))
        await writer.drain()
        raise
    core = _Core(backend)
    writer.write(_frame(Ready(os.getpid(), backend.health())))
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
        asyncio.run(_serve(sock))
    finally:
        log.info("engine core exits after %.0f s", time.perf_counter() - t0)


if __name__ == "__main__":
    main()
