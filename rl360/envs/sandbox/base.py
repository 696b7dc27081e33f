"""The Sandbox contract: run commands and move files in an isolated place, with caps.

A sandbox lives for one episode. `exec` runs a command (a shell string or an argv list) in the
sandbox's work dir and returns an `ExecResult`; `write_file` / `read_file` move bytes; `close`
kills every process the sandbox started and frees what it used. Paths are inside the sandbox:
a relative path is relative to `Sandbox.workdir`.

The backends are listed in `rl360.envs.sandbox.factory.SANDBOXES`; `build_sandbox("auto",
limits)` picks bwrap where bubblewrap works and fails elsewhere, unless `allow_unsandboxed` lets
it fall back to the process backend.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from typing import ClassVar

import msgspec

from rl360.recipe import SandboxLimits

log = logging.getLogger(__name__)


READ_CAP = 8 << 20  # the most bytes one read_file returns, whatever the caller asks for
STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, its helper died, an op broke): an
    infrastructure failure, never the model's fault."""


class SandboxStartError(SandboxError):
    """The sandbox could not be started."""


class ExecResult(msgspec.Struct, omit_defaults=True):
    """What one exec produced. exit_code is the process's exit status, or -N when a signal N
    killed it (a timeout kills with SIGKILL: -9 and timed_out=True)."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    warm: bool = False  # run in a fork of the sandbox's warm interpreter (exec server)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class Protections(msgspec.Struct):
    """Which protections hold for one sandbox, as a value each ("" means missing)."""

    network: str = ""  # how outgoing network is blocked
    filesystem: str = ""  # how the host's files are hidden / kept read-only
    procs: str = ""  # how the process count is capped
    memory: str = ""  # how memory is capped
    cpu: str = ""  # how CPU time is capped
    disk: str = ""  # how the writable space is capped
    cleanup: str = ""  # how every process is killed on close
    helper: str = ""  # how the sandbox's own exec helper is kept safe from the code it runs

    def missing(self) -> list[str]:
        return [f for f in self.__struct_fields__ if not getattr(self, f)]


class Sandbox(abc.ABC):
    """One isolated place to run an episode's commands. Use as an async context manager or
    call `close()`; `start()` is called by the first operation if not called before."""

    backend: ClassVar[str] = ""

    def __init__(self, limits: SandboxLimits | None = None, workdir: str | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.workdir = workdir or "/sandbox"
        self.protections = Protections()
        self._started = False
        self._closed = False

    @abc.abstractmethod
    async def start(self) -> None:
        """Start the sandbox; idempotent. Raises SandboxStartError."""

    @abc.abstractmethod
    async def exec(
        self,
        cmd: str | Sequence[str],
        timeout: float | None = None,  # noqa: ASYNC109  (the Sandbox contract)
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run `cmd` (a string runs under /bin/sh -c) and wait for it, at most `timeout` seconds
        (default limits.timeout), killing its process group when time is up. `stdin` (bytes)
        is what the command reads on its stdin (no file in the sandbox holds it); default
        empty."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: str | bytes, mode: int | None = None) -> None:
        """Write `data` to `path` (parents created). Raises FileNotFoundError/OSError-like
        SandboxFileError for a path the sandbox refuses."""

    @abc.abstractmethod
    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """Read `path`; raises SandboxFileError when it is missing or unreadable."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Kill every process of the sandbox and free its resources; idempotent."""

    async def sweep(self, dirs: Sequence[str] = ()) -> int:
        """Kill every process of the sandbox except its own helper and empty `dirs` (a clean
        room before grading). Returns how many stray processes it killed. Must not run while
        another exec of the same sandbox is in flight (that exec's processes die too)."""
        raise SandboxError(f"{self.backend} sandbox cannot sweep its processes")

    def clean_env(self) -> dict[str, str]:
        """The environment the backend itself gives a process it starts (PATH, locale, temp
        dir, and what it needs to find its processes again), never anything that code run in
        the sandbox set: the base a verifier starts from (`rl360.envs.verifier`)."""
        return {"PATH": STANDARD_PATH, "LANG": "C.UTF-8", "TMPDIR": "/tmp"}

    async def host_pids(self) -> list[int]:
        """Host pids of the sandbox's processes right now (diagnostics and tests)."""
        return []

    async def __aenter__(self) -> Sandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"{self.backend} sandbox is closed")


class SandboxFileError(OSError):
    """A file op inside the sandbox failed (missing file, no space, read-only path)."""
