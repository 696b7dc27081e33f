"""Sandboxes that run one exec server (server.py) for their whole life: bwrap and process.

Starting the sandbox pays the isolation cost once (namespaces, cgroups, interpreter start);
each exec afterwards is one fork+exec inside it plus a pipe round trip.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
import uuid
from collections.abc import Sequence
from typing import Any

from rl360.envs.sandbox.base import (
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxStartError,
)
from rl360.envs.sandbox.channel import ServerChannel, shell_argv

log = logging.getLogger(__name__)
START_TIMEOUT_S = 20.0
_warned: set[str] = set()


def warn_once(msg: str) -> None:
    """Log a missing protection at WARNING the first time, then at DEBUG."""
    if msg in _warned:
        log.debug(msg)
        return
    _warned.add(msg)
    log.warning(msg)


def _write_autogroup(pid: int, nice: int) -> None:
    with open(f"/proc/{pid}/autogroup", "w") as f:  # procfs: never blocks
        f.write(str(min(max(nice, 0), 19)))


async def nice_autogroup(pid: int, nice: int, tries: int = 3) -> bool:
    """Give the scheduler autogroup of `pid`'s session the niceness `nice`. Linux shares the
    CPU between sessions first (autogroups, `kernel.sched_autogroup_enabled`, on by default in
    most distributions) and by niceness only inside one, so a sandbox in a session of its own
    gets as much CPU as the whole Ray node beside it (engine, session shards, env actors
    together) whatever its processes' niceness. True once set, or where the kernel has no
    autogroups; False where it refuses (an unprivileged caller may change one every 100 ms
    host-wide: EAGAIN, tried again)."""
    for attempt in range(tries):
        try:
            _write_autogroup(pid, nice)
            return True
        except FileNotFoundError:
            return True
        except BlockingIOError:
            if attempt + 1 < tries:
                await asyncio.sleep(0.11)
        except OSError:
            return False
    return False


class ServedSandbox(Sandbox):
    """A Sandbox whose ops go to an exec server started by `_launch`."""

    def __init__(self, limits: SandboxLimits | None = None, workdir: str | None = None) -> None:
        super().__init__(limits, workdir)
        self.sandbox_id = f"rl360-{self.backend}-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self._proc: asyncio.subprocess.Process | None = None
        self._chan: ServerChannel | None = None
        self._start_lock = asyncio.Lock()
        self.start_s = 0.0
        self.ready_info: dict[str, Any] = {}  # the exec server's ready message (pid, template)

    @abc.abstractmethod
    async def _prepare(self) -> tuple[list[str], dict[str, str], str | None]:
        """Set up host-side resources; return (argv, env, cwd) that start the exec server."""

    async def _after_ready(self) -> None:
        """Host-side set-up that needs the running sandbox (e.g. its network); raise to fail
        the start."""

    @abc.abstractmethod
    async def _teardown(self) -> None:
        """Kill every remaining process and free host-side resources (after the server died)."""

    async def start(self) -> None:
        if self._started:
            return
        self._check_open()
        async with self._start_lock:
            if self._started:
                return
            t0 = time.monotonic()
            try:
                argv, env, cwd = await self._prepare()
                if self.limits.nice > 0 and shutil.which("nice"):
                    argv = ["nice", "-n", str(min(self.limits.nice, 19)), *argv]
                self._proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                )
                if self.limits.nice > 0 and not await nice_autogroup(self._proc.pid,
                                                                     self.limits.nice):
                    warn_once("sandbox: could not nice the sandbox's scheduler autogroup "
                              "(/proc/PID/autogroup): where the kernel groups sessions, its "
                              "code competes with the engines at full weight")
                self._chan = ServerChannel(self._proc, self.sandbox_id)
                self.ready_info = await self._chan.wait_ready(START_TIMEOUT_S)
                await self._after_ready()
            except (OSError, SandboxError, ValueError, RuntimeError) as e:
                await self._kill_and_teardown()
                self._closed = True
                if isinstance(e, SandboxStartError):
                    raise
                raise SandboxStartError(f"{self.backend} sandbox failed to start: {e}") from e
            except BaseException:
                await self._kill_and_teardown()
                self._closed = True
                raise
            self.start_s = time.monotonic() - t0
            self._started = True

    def _channel(self) -> ServerChannel:
        if self._chan is None:
            raise SandboxError(f"{self.backend} sandbox is not started")
        return self._chan

    async def exec(
        self,
        cmd: str | Sequence[str],
        timeout: float | None = None,  # noqa: ASYNC109  (the Sandbox contract)
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        self._check_open()
        await self.start()
        t = float(timeout) if timeout is not None else self.limits.timeout
        if t <= 0:
            raise ValueError(f"exec timeout must be > 0, got {timeout}")
        return await self._channel().exec(
            shell_argv(cmd), t, cwd, env, self.limits.output_bytes, stdin
        )

    async def write_file(self, path: str, data: str | bytes, mode: int | None = None) -> None:
        self._check_open()
        await self.start()
        blob = data.encode() if isinstance(data, str) else bytes(data)
        await self._channel().write_file(path, blob, mode)

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        self._check_open()
        await self.start()
        return await self._channel().read_file(path, max_bytes)

    async def close(self) -> None:
        if self._closed and self._proc is None:
            return
        self._closed = True
        await self._kill_and_teardown()

    async def _kill_and_teardown(self) -> None:
        if self._chan is not None:
            await self._chan.close()
            self._chan = None
        proc, self._proc = self._proc, None
        if proc is not None:
            await self._stop_inside(proc)
            # the launcher leads its own process group; no proc.kill(): Popen.send_signal polls
            # first and may reap the child under asyncio's child watcher
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                log.error(
                    "%s: launcher pid %d did not exit after SIGKILL", self.sandbox_id, proc.pid
                )
        await self._teardown()

    async def _stop_inside(self, proc: asyncio.subprocess.Process) -> None:
        """Stop what runs under the launcher so that the launcher reaps it and exits by itself
        (bwrap: the sandbox's init); the default stops nothing here. A process whose parent dies
        unreaped goes to the host's init, which may reap it late or never: a zombie per sandbox
        (seen in a VM whose init reaps lazily, uid 65534, parent 1)."""
