"""The process sandbox: a fallback for hosts without bubblewrap or Docker.

The exec server runs as a plain subprocess in its own session, in a private temp work dir;
each exec'd process gets its own session and the rlimits a process may always lower: CPU time,
address space (memory per process) and file size (per file). It does NOT isolate the network
or the filesystem, cannot cap the process count (RLIMIT_NPROC counts every process of the host
user and root ignores it), cannot cap total disk use, and cannot keep the commands from killing
its exec server with SIGKILL (it ignores every other signal; a killed server is the model's own
failure: a scored error); it says so in a warning.
On close it kills the server's and each exec's process group, then every process still
carrying the sandbox's id in its environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Sequence

from rl360.envs.sandbox.base import SandboxLimits
from rl360.envs.sandbox.channel import server_argv
from rl360.envs.sandbox.interp import resolve_python
from rl360.envs.sandbox.served import ServedSandbox, warn_once

log = logging.getLogger(__name__)
MARKER = "RL360_SANDBOX_ID"


def _marked_pids(marker: str) -> list[int]:
    """Host pids whose environment carries MARKER=marker (readable for own-uid processes)."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


class ProcessSandbox(ServedSandbox):
    backend = "process"

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        workdir: str | None = None,
        python: str | None = None,
    ) -> None:
        super().__init__(limits, workdir)
        self._own_workdir = workdir is None
        self.workdir = workdir or ""
        self.python = resolve_python(python)

    def clean_env(self) -> dict[str, str]:
        return {"PATH": f"{self.python.bin_dir}:/usr/local/bin:/usr/bin:/bin",
                "TMPDIR": os.path.join(self.workdir, ".tmp"), "LANG": "C.UTF-8",
                MARKER: self.sandbox_id}

    async def _prepare(self) -> tuple[list[str], dict[str, str], str | None]:
        lim = self.limits
        if self._own_workdir:
            self.workdir = tempfile.mkdtemp(prefix="rl360-sandbox-")
        else:
            os.makedirs(self.workdir, exist_ok=True)
        tmp = os.path.join(self.workdir, ".tmp")
        os.makedirs(tmp, exist_ok=True)
        mib = 1024 * 1024
        rlimits = {
            "RLIMIT_CPU": lim.cpu_seconds,
            "RLIMIT_AS": (lim.memory_mb + 256) * mib,  # + room for the interpreter's mappings
            "RLIMIT_FSIZE": lim.disk_mb * mib,
            "RLIMIT_CORE": 0,
        }
        config = {"workdir": self.workdir, "rlimits": rlimits}
        env = {**self.clean_env(), "HOME": self.workdir, "PYTHONDONTWRITEBYTECODE": "1"}
        argv = server_argv(self.python.executable, config)
        p = self.protections
        p.cpu = f"RLIMIT_CPU {lim.cpu_seconds}s per process"
        p.memory = f"RLIMIT_AS {lim.memory_mb + 256} MiB per process (not the sandbox total)"
        p.cleanup = "process groups, then every process carrying the sandbox id in its environment"
        warn_once(
            f"process sandbox (uid {os.geteuid()}): NO network isolation, NO filesystem isolation, "
            "NO process-count cap, memory capped per process only (RLIMIT_AS), disk capped per "
            "file only (RLIMIT_FSIZE), exec server killable (SIGKILL) by the commands; install bubblewrap "
            "for the bwrap sandbox"
        )
        return argv, env, self.workdir

    async def _teardown(self) -> None:
        for _ in range(50):
            pids = await asyncio.to_thread(_marked_pids, self.sandbox_id)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.02)
        else:
            log.error(
                "%s: processes survived close: %s", self.sandbox_id, _marked_pids(self.sandbox_id)
            )
        if self._own_workdir and self.workdir:
            await asyncio.to_thread(shutil.rmtree, self.workdir, True)

    async def sweep(self, dirs: Sequence[str] = ()) -> int:
        self._check_open()
        await self.start()
        # the exec server and its warm template (server.py) are the sandbox's own helpers
        spare = {self._proc.pid if self._proc is not None else -1, self.ready_info.get("template")}
        killed = 0
        for _ in range(50):
            pids = [p for p in await asyncio.to_thread(_marked_pids, self.sandbox_id)]
            pids = [p for p in pids if p not in spare]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
            await asyncio.sleep(0.02)
        if dirs:
            await self._channel().sweep(dirs)  # not init here: empties the dirs only
        return killed

    async def host_pids(self) -> list[int]:
        return await asyncio.to_thread(_marked_pids, self.sandbox_id)
