"""Host side of the in-sandbox exec server (see server.py): framing, request ids, and the
ExecResult / file-op wrappers shared by the bwrap and process backends."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import marshal
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl360.envs.sandbox.base import ExecResult, SandboxError, SandboxFileError, SandboxStartError
from rl360.envs.sandbox.boot import BOOT, boot_head

HDR = struct.Struct(">I")
SERVER_SOURCE = (Path(__file__).with_name("server.py")).read_text()
EXEC_GRACE_S = 10.0  # host-side safety margin over an exec's own timeout


def server_argv(python: str, config: dict[str, Any]) -> list[str]:
    """The command that starts the exec server with the given interpreter (isolated mode, no
    site: nothing on the host's import path reaches it): BOOT, which reads the server compiled
    from stdin (`ServerChannel` writes it first), and the config as marshal in hex."""
    return [python, "-I", "-S", "-c", BOOT, marshal.dumps(config).hex()]


def shell_argv(cmd: str | Sequence[str]) -> list[str]:
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", cmd]
    argv = [str(a) for a in cmd]
    if not argv:
        raise ValueError("exec needs a non-empty command")
    return argv


def _file_error(op: str, path: str, header: dict[str, Any]) -> SandboxFileError:
    err = SandboxFileError(f"{op} {path}: {header.get('error')}")
    err.errno = header.get("errno") or None
    return err


class ServerChannel:
    """Request/response over the server's stdin/stdout; many requests may be in flight."""

    def __init__(self, proc: asyncio.subprocess.Process, label: str) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.label = label
        # what the server's BOOT reads first (server_argv): the server compiled; requests follow
        proc.stdin.write(boot_head(SERVER_SOURCE, "server.py"))
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[dict[str, Any], list[bytes]]]] = {}
        self._ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._stderr_tail = bytearray()
        self._write_lock = asyncio.Lock()
        self._dead: str | None = None
        self._reader = asyncio.create_task(self._read_loop(), name=f"{label}-reader")
        self._err_reader = asyncio.create_task(self._read_stderr(), name=f"{label}-stderr")

    @property
    def stderr_tail(self) -> str:
        return self._stderr_tail.decode(errors="replace").strip()

    async def wait_ready(self, within_s: float) -> dict[str, Any]:
        try:
            return await asyncio.wait_for(asyncio.shield(self._ready), within_s)
        except TimeoutError:
            raise SandboxStartError(
                f"{self.label}: exec server not ready after {within_s:.0f}s: {self.stderr_tail}"
            ) from None
        except SandboxError as e:
            raise SandboxStartError(str(e)) from None

    async def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        while chunk := await self.proc.stderr.read(4096):
            self._stderr_tail += chunk
            del self._stderr_tail[:-4096]

    async def _read_loop(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        try:
            while True:
                (n,) = HDR.unpack(await stdout.readexactly(HDR.size))
                header = json.loads(await stdout.readexactly(n))
                blobs = [await stdout.readexactly(size) for size in header.get("blobs", [])]
                if header.get("ready"):
                    if not self._ready.done():
                        self._ready.set_result(header)
                    continue
                fut = self._pending.pop(header.get("id"), None)
                if fut is not None and not fut.done():
                    fut.set_result((header, blobs))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            await asyncio.sleep(0.05)  # let the stderr reader catch the last words
            self._fail(f"{self.label}: exec server exited ({type(e).__name__}): {self.stderr_tail}")

    def _fail(self, why: str) -> None:
        self._dead = why
        err = SandboxError(why)
        if not self._ready.done():
            self._ready.set_exception(err)
            self._ready.exception()  # mark retrieved
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()

    async def call(
        self, header: dict[str, Any], blobs: Sequence[bytes] = (), within_s: float | None = None
    ) -> tuple[dict[str, Any], list[bytes]]:
        if self._dead:
            raise SandboxError(self._dead)
        rid = next(self._ids)
        header = {**header, "id": rid, "blobs": [len(b) for b in blobs]}
        fut: asyncio.Future[tuple[dict[str, Any], list[bytes]]]
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        head = marshal.dumps(header)  # the server reads marshal (no `json` import there)
        assert self.proc.stdin is not None
        try:
            async with self._write_lock:
                self.proc.stdin.write(HDR.pack(len(head)) + head)
                for b in blobs:
                    self.proc.stdin.write(b)
                await self.proc.stdin.drain()
        except (ConnectionError, RuntimeError) as e:
            self._pending.pop(rid, None)
            raise SandboxError(f"{self.label}: exec server gone: {e}; {self.stderr_tail}") from e
        try:
            return await asyncio.wait_for(fut, within_s)
        except TimeoutError:
            self._pending.pop(rid, None)
            raise SandboxError(
                f"{self.label}: no answer to {header['op']} in {within_s}s"
            ) from None

    # ------------------------------------------------------------------ typed ops

    async def exec(
        self,
        argv: list[str],
        limit_s: float,
        cwd: str | None,
        env: dict[str, str] | None,
        cap: int,
        stdin: bytes | None = None,
    ) -> ExecResult:
        t0 = time.monotonic()
        req = {"op": "exec", "argv": argv, "timeout": limit_s, "cwd": cwd, "env": env, "cap": cap}
        blobs_in = () if stdin is None else (stdin,)
        header, blobs = await self.call(req, blobs_in, within_s=limit_s + EXEC_GRACE_S)
        if not header.get("ok"):
            raise SandboxError(f"{self.label}: exec failed: {header.get('error')}")
        return ExecResult(
            stdout=blobs[0].decode(errors="replace"),
            stderr=blobs[1].decode(errors="replace"),
            exit_code=int(header["rc"]),
            timed_out=bool(header.get("timed_out")),
            stdout_truncated=bool(header.get("out_trunc")),
            stderr_truncated=bool(header.get("err_trunc")),
            wall_s=time.monotonic() - t0,
            warm=bool(header.get("warm")),
        )

    async def write_file(self, path: str, data: bytes, mode: int | None) -> None:
        header, _ = await self.call({"op": "write", "path": path, "mode": mode}, [data], 120.0)
        if not header.get("ok"):
            raise _file_error("write", path, header)

    async def read_file(self, path: str, max_bytes: int | None) -> bytes:
        header, blobs = await self.call({"op": "read", "path": path, "max": max_bytes}, (), 120.0)
        if not header.get("ok"):
            raise _file_error("read", path, header)
        return blobs[0]

    async def sweep(self, dirs: Sequence[str]) -> dict[str, Any]:
        header, _ = await self.call({"op": "sweep", "dirs": list(dirs)}, (), 60.0)
        if not header.get("ok"):
            raise SandboxError(f"{self.label}: sweep failed: {header.get('error')}")
        return header

    async def close(self) -> None:
        for task in (self._reader, self._err_reader):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.proc.stdin is not None:
            with contextlib.suppress(Exception):
                self.proc.stdin.close()
