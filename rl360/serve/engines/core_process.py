"""The torch engine in a process of its own (`engine.core_process = true`).

A Serve replica's process runs Serve's request handling (gRPC, request wrapping, metrics) on
its asyncio loop; with the torch engine in the same process its decode steps share one GIL with
that loop (docs/sessions.md: a decode step 12-25% slower in a replica than in process).
`CoreProcessBackend` keeps the replica's side to forwarding: it starts
`python -m rl360.serve.engines.core_child` (the engine core: a `TorchBackend` on its own loop
and thread) and talks to it over a Unix socket pair in length-prefixed msgpack frames
(rl360.serve.engines.core_wire), as vLLM's front end talks to its EngineCore.

What crosses the socket: requests (prompt ids + sampling) and their generations, cancellations
(a cancelled caller's row leaves at the core's next step), pause / resume, health, and weight
versions. A version's tensors do not go through the socket: the replica writes them into one
shared-memory buffer (a memfd it keeps and reuses) and sends their layout; the core maps the
buffer read-only through /proc/<replica pid>/fd/<fd> and copies them into its parameters. That
is one copy more than a torch engine serving a weight slot in place (docs/weight-sync.md):
the core loads every version by copy, as `zero_copy = false` does.

Once the replica serves the published weights it opens a channel to the core (a Unix socket in
a directory only this user can enter; `EngineCore.open_channel`): session shards on the node
send a session's generations straight to it (rl360.serve.engines.core_client.CoreChannels, the
replica the affinity router would pick), with no Serve router, gRPC channel or replica process
on the way.

The core exits when the socket closes: the replica closed it, or its process ended and the
kernel closed it (the core's loop reads the socket apart from its engine thread, so it notices
within a decode step; not PR_SET_PDEATHSIG, which fires when the *thread* that started the
core exits, and Serve may build a replica on a worker thread). A core that dies fails every
waiting request with the reason and makes `health()["ok"]` false, so Serve's health check
replaces the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
from typing import Any

import msgspec

from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.base import check_prompt
from rl360.serve.engines.core_client import CoreChannels, CoreConnection
from rl360.serve.engines.core_wire import (
    Call,
    CoreDied,
    Failed,
    FromCore,
    Ready,
    StagingBuffer,
    Start,
    Update,
    frame,
    recv_frame_blocking,
)
from rl360.types import Generation, SamplingParams
from rl360.weights.payloads import TensorUpdate, WeightUpdate, refuse
from rl360.weights.plan import update_checksums
from rl360.weights.receiver import Intake, WeightChecksums

__all__ = ["CoreChannels", "CoreConnection", "CoreDied", "CoreProcessBackend"]

log = logging.getLogger("rl360.engine.core")

START_TIMEOUT_S = 600.0  # the core's import + model load (a large checkpoint on a slow disk)
HEALTH_EVERY_S = 1.0  # how often the replica refreshes the core's health figures


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
            [sys.executable, "-m", "rl360.serve.engines.core_child", str(child.fileno())],
            pass_fds=[child.fileno()], env=env, close_fds=True)
        child.close()
        self._version = 0
        self._health: dict[str, Any] = {}
        self._conn: CoreConnection | None = None
        self._connecting: asyncio.Future[CoreConnection] | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._buffer: StagingBuffer | None = None
        self._closed = False
        self.node = ""  # the node the core runs on (Ray's node id), for session shards
        try:
            self._sock.settimeout(START_TIMEOUT_S)
            self._sock.sendall(frame(Start(engine, model_cfg, seed)))
            ready = msgspec.msgpack.decode(recv_frame_blocking(self._sock), type=FromCore)
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
            self._buffer = StagingBuffer()
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
