"""The torch engine in a process of its own (`engine.core_process = true`).

A Serve replica's process runs Serve's request handling (gRPC, request wrapping, metrics) on
its asyncio loop; with the torch engine in the same process its decode steps share one GIL with
that loop (README "Session path": a decode step 1.1-1.3 ms in a replica against 0.95 in
process, the step thread idle ~20% of the time). `CoreProcessBackend` keeps the replica's side
to forwarding: it starts `python -m rl360.serve.engines.core_process` (the engine core: a
`TorchBackend` on its own loop and thread) and talks to it over a Unix socket pair in
length-prefixed msgpack frames, as vLLM's front end talks to its EngineCore.

What crosses the socket: requests (prompt ids + sampling) and their generations, cancellations
(a cancelled caller's row leaves at the core's next step), pause / resume, health, and weight
versions. A version's tensors do not go through the socket: the replica writes them into one
shared-memory buffer (a memfd it keeps and reuses) and sends their layout; the core maps the
buffer read-only through /proc/<replica pid>/fd/<fd> and copies them into its parameters. That
is one copy more than a torch engine serving a weight slot in place (README "Weight sync"):
the core loads every version by copy, as `zero_copy = false` does.

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
import time
from typing import Any

import msgspec

from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.base import check_prompt
from rl360.types import Generation, SamplingParams

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
        self._next_id = 0
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._connecting: asyncio.Future[None] | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._buffer: _StagingBuffer | None = None
        self._closed = False
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
        rid, fut = await self._send(lambda i: Gen(i, list(prompt_ids), sampling))
        try:
            return await fut
        except asyncio.CancelledError:  # the caller went away: its row leaves at the next step
            if self._failure is None and self._writer is not None and not self._closed:
                self._writer.write(_frame(Cancel(rid)))
            raise

    async def update_weights(self, version: int, state: Any) -> bool:
        if hasattr(state, "__await__") and not isinstance(state, dict):
            state = await state  # a Ray ObjectRef
        if not isinstance(state, dict):
            raise TypeError(f"engine core: a weight version must be a name -> tensor dict, "
                            f"not {type(state).__name__}")
        if self._buffer is None:
            self._buffer = _StagingBuffer()
        entries = await asyncio.to_thread(self._buffer.stage, state)
        _, fut = await self._send(lambda i: Update(i, version, os.getpid(), self._buffer.fd,
                                                   entries))
        ok = bool(await fut)
        if ok:
            self._version = max(self._version, version)
        return ok

    async def pause(self) -> None:
        await self._call("pause")

    async def resume(self) -> None:
        await self._call("resume")

    def health(self) -> dict[str, Any]:
        """The core's health as of its last report (refreshed every HEALTH_EVERY_S while the
        replica serves), with the core's pid; not ok once the core has died."""
        out = {**self._health, "core_process": True, "core_pid": self.core_pid}
        if self._failure is not None:
            out |= {"ok": False, "error": repr(self._failure)}
        return out

    async def close(self) -> None:
        if self._closed:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._call("close"), 10.0)
        self._closed = True
        for t in (self._reader_task, self._health_task):
            if t is not None:
                t.cancel()
        if self._writer is not None:
            self._writer.close()
        self._kill()
        if self._buffer is not None:
            self._buffer.close()

    # ------------------------------------------------------------------ the socket

    async def _ensure_connected(self) -> None:
        if self._writer is not None:
            return
        if self._connecting is None:  # one connection: concurrent first callers share it
            self._connecting = asyncio.ensure_future(self._connect())
        await asyncio.shield(self._connecting)

    async def _connect(self) -> None:
        reader, writer = await asyncio.open_unix_connection(sock=self._sock)
        self._writer = writer
        loop = asyncio.get_running_loop()
        self._reader_task = loop.create_task(self._read(reader), name="rl360-engine-core-reader")
        self._reader_task.add_done_callback(self._on_reader_done)
        self._health_task = loop.create_task(self._refresh_health(),
                                             name="rl360-engine-core-health")

    async def _send(self, make: Any) -> tuple[int, asyncio.Future[Any]]:
        if self._failure is not None:
            raise CoreDied(f"the engine core process is gone: {self._failure}")
        await self._ensure_connected()
        assert self._writer is not None
        self._next_id += 1
        rid = self._next_id
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        self._writer.write(_frame(make(rid)))
        return rid, fut

    async def _call(self, what: str) -> Any:
        _, fut = await self._send(lambda i: Call(i, what))
        return await fut

    async def _read(self, reader: asyncio.StreamReader) -> None:
        decode = msgspec.msgpack.Decoder(FromCore).decode
        while True:
            try:
                msg = decode(await _read_frame(reader))
            except asyncio.IncompleteReadError:
                code = self._proc.poll()
                raise CoreDied(f"the engine core process (pid {self._proc.pid}) exited"
                               + (f" with code {code}" if code is not None else "")) from None
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
        if not self._closed:
            log.error("engine core process: %r", exc)
        self._failure = exc
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(CoreDied(str(exc)))
        self._waiting.clear()

    async def refresh_health(self) -> dict[str, Any]:
        """Ask the core for its health now (what `health()` then returns)."""
        self._health = dict(await self._call("health"))
        self._version = max(self._version, int(self._health.get("version", 0)))
        return self.health()

    async def _refresh_health(self) -> None:
        while self._failure is None and not self._closed:
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

        tensors = {k: torch.as_tensor(v) for k, v in state.items()}
        entries, at = [], 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            entries.append(Entry(name, str(t.dtype).removeprefix("torch."), list(t.shape),
                                 at, nbytes))
            at += -(-nbytes // 64) * 64
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


async def _serve(sock: socket.socket) -> None:
    from rl360.serve.engines.torch_backend import TorchBackend

    reader, writer = await asyncio.open_unix_connection(sock=sock)
    decode = msgspec.msgpack.Decoder(ToCore).decode
    start = decode(await _read_frame(reader))
    if not isinstance(start, Start):
        raise RuntimeError(f"engine core: expected Start, got {type(start).__name__}")
    try:
        backend = TorchBackend(start.engine, start.model, start.seed)
    except Exception as e:
        writer.write(_frame(Failed(0, "runtime", f"{type(e).__name__}: {e}")))
        await writer.drain()
        raise
    writer.write(_frame(Ready(os.getpid(), backend.health())))
    tasks: dict[int, asyncio.Task[Any]] = {}

    def reply(rid: int, task: asyncio.Task[Any]) -> None:
        tasks.pop(rid, None)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            kind = "value" if isinstance(exc, ValueError) else "runtime"
            writer.write(_frame(Failed(rid, kind, f"{type(exc).__name__}: {exc}")))
            return
        value = task.result()
        writer.write(_frame(GenDone(rid, value) if isinstance(value, Generation)
                            else Done(rid, value)))

    async def update(msg: Update) -> bool:
        state, mm = await asyncio.to_thread(_load_update, msg)
        try:
            return await backend.update_weights(msg.version, state)
        finally:
            del state
            with contextlib.suppress(BufferError):
                mm.close()

    async def call(what: str) -> Any:
        if what == "pause":
            await backend.pause()
        elif what == "resume":
            await backend.resume()
        elif what == "health":
            return backend.health()
        elif what == "close":
            await backend.close()
        else:
            raise ValueError(f"engine core: unknown call {what!r}")
        return None

    loop = asyncio.get_running_loop()
    while True:
        try:
            msg = decode(await _read_frame(reader))
        except asyncio.IncompleteReadError:  # the replica is gone
            break
        if isinstance(msg, Cancel):
            task = tasks.get(msg.id)
            if task is not None:
                task.cancel()
            continue
        if isinstance(msg, Gen):
            coro: Any = backend.generate(msg.prompt_ids, msg.sampling)
        elif isinstance(msg, Update):
            coro = update(msg)
        elif isinstance(msg, Call):
            coro = call(msg.what)
        else:
            continue
        task = loop.create_task(coro, name=f"rl360-engine-core-{msg.id}")
        tasks[msg.id] = task
        task.add_done_callback(lambda t, rid=msg.id: reply(rid, t))
        if isinstance(msg, Call) and msg.what == "close":
            await asyncio.wait({task})
            await writer.drain()
            break
    await backend.close()


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
