"""The Docker sandbox, for hosts with a running Docker engine (and tasks with their own image).

One container per sandbox (`docker run -d ... sleep infinity`, sleep as pid 1) with no network, capped memory,
pids and CPUs, a read-only root, size-capped tmpfs work dir and /tmp, no capabilities and
no-new-privileges; each exec is a `docker exec`. The docker CLI is driven via subprocess (no
SDK). On a timeout every process of the container except its init is killed (docker exec
gives no handle on the exec'd process tree); close removes the container.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Sequence

from rl360.envs.sandbox.base import (
    READ_CAP,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxFileError,
    SandboxLimits,
    SandboxStartError,
)
from rl360.envs.sandbox.channel import shell_argv

log = logging.getLogger(__name__)
DEFAULT_IMAGE = "python:3.11-slim"


@functools.cache
def docker_unavailable() -> str | None:
    exe = shutil.which("docker")
    if exe is None:
        return "the docker CLI is not installed"
    try:
        out = subprocess.run(
            [exe, "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"docker info failed: {e}"
    if out.returncode != 0:
        return "no Docker engine is running: " + out.stderr.decode(errors="replace").strip()[:200]
    return None


class _Capped:
    def __init__(self, cap: int) -> None:
        self.cap, self.data, self.total = cap, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]

    @property
    def truncated(self) -> bool:
        return self.total > self.cap


async def _drain(stream: asyncio.StreamReader | None, sink: _Capped) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        sink.add(chunk)


class DockerSandbox(Sandbox):
    backend = "docker"

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        workdir: str | None = None,
        *,
        image: str | None = None,
        scratch_dirs: Sequence[str] = (),
        user: str | None = "65534:65534",
    ) -> None:
        super().__init__(limits, workdir)
        self.image = image or DEFAULT_IMAGE
        self.scratch_dirs = list(scratch_dirs)
        self.user = user
        self.container = f"rl360-{uuid.uuid4().hex[:12]}"
        self._docker = shutil.which("docker") or "docker"

    async def _run(
        self, *args: str, stdin: bytes | None = None, limit_s: float = 60.0, cap: int = 1 << 20
    ) -> tuple[int, _Capped, _Capped, bool]:
        proc = await asyncio.create_subprocess_exec(
            self._docker,
            *args,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = _Capped(cap), _Capped(cap)
        if stdin is not None and proc.stdin is not None:
            proc.stdin.write(stdin)
            await proc.stdin.drain()
            proc.stdin.close()
        readers = asyncio.gather(_drain(proc.stdout, out), _drain(proc.stderr, err), proc.wait())
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(readers), limit_s)
        except TimeoutError:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await readers
        return proc.returncode if proc.returncode is not None else -9, out, err, timed_out

    async def start(self) -> None:
        if self._started:
            return
        self._check_open()
        lim, mib = self.limits, 1024 * 1024
        args = [
            "run",
            "-d",
            "--rm",
            "--name",
            self.container,
            "--network",
            "bridge" if lim.network else "none",
            "--memory",
            f"{lim.memory_mb}m",
            "--memory-swap",
            f"{lim.memory_mb}m",
            "--pids-limit",
            str(lim.max_procs),
            "--cap-drop",
            "ALL",
            "--security-opt",
            "no-new-privileges",
            "--read-only",
            "--ulimit",
            f"cpu={lim.cpu_seconds}:{lim.cpu_seconds + 1}",
            "--ulimit",
            "core=0",
            "--tmpfs",
            f"/tmp:rw,exec,size={lim.tmp_mb * mib}",
            "--tmpfs",
            f"{self.workdir}:rw,exec,size={lim.disk_mb * mib},mode=1777",
            "--workdir",
            self.workdir,
        ]
        for d in self.scratch_dirs:
            args += ["--tmpfs", f"{d}:rw,exec,size={lim.disk_mb * mib},mode=1777"]
        if lim.cpus:
            args += ["--cpus", str(lim.cpus)]
        if self.user:
            args += ["--user", self.user]
        args += [self.image, "sleep", "infinity"]
        rc, _, err, _ = await self._run(*args, limit_s=300.0)
        if rc != 0:
            self._closed = True
            raise SandboxStartError(
                f"docker run {self.image} failed: {err.data.decode(errors='replace').strip()}"
            )
        p = self.protections
        p.network = "" if lim.network else "--network none"
        p.filesystem = "container image, read-only root"
        p.procs, p.memory = f"--pids-limit {lim.max_procs}", f"--memory {lim.memory_mb}m"
        p.cpu, p.disk = f"--ulimit cpu={lim.cpu_seconds}", f"tmpfs work dir {lim.disk_mb} MiB"
        p.cleanup = "docker rm -f"
        self._started = True

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
        args = ["exec", "-i", "-w", cwd or self.workdir]
        for k, v in (env or {}).items():
            args += ["-e", f"{k}={v}"]
        t0 = time.monotonic()
        rc, out, err, timed_out = await self._run(
            *args,
            self.container,
            *shell_argv(cmd),
            stdin=stdin,
            limit_s=t,
            cap=self.limits.output_bytes,
        )
        if timed_out:  # the exec'd tree lives on in the container: kill all but init
            await self._run("exec", self.container, "sh", "-c", "kill -9 -1", limit_s=10.0)
        return ExecResult(
            stdout=out.data.decode(errors="replace"),
            stderr=err.data.decode(errors="replace"),
            exit_code=-9 if timed_out else rc,
            timed_out=timed_out,
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
            wall_s=time.monotonic() - t0,
        )

    async def write_file(self, path: str, data: str | bytes, mode: int | None = None) -> None:
        self._check_open()
        await self.start()
        blob = data.encode() if isinstance(data, str) else bytes(data)
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1"'
        if mode is not None:
            script += f' && chmod {mode:o} "$1"'
        rc, _, err, _ = await self._run(
            "exec",
            "-i",
            "-w",
            self.workdir,
            self.container,
            "sh",
            "-c",
            script,
            "sh",
            path,
            stdin=blob,
        )
        if rc != 0:
            raise SandboxFileError(f"write {path}: {err.data.decode(errors='replace').strip()}")

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        self._check_open()
        await self.start()
        limit = READ_CAP if max_bytes is None else min(int(max_bytes), READ_CAP)
        cmd = f"head -c {limit} {shlex.quote(path)}"
        rc, out, err, _ = await self._run(
            "exec", "-w", self.workdir, self.container, "sh", "-c", cmd, cap=1 << 31
        )
        if rc != 0:
            raise SandboxFileError(f"read {path}: {err.data.decode(errors='replace').strip()}")
        return bytes(out.data)

    async def sweep(self, dirs: Sequence[str] = ()) -> int:
        self._check_open()
        await self.start()
        wipe = " ".join(
            f"{shlex.quote(d.rstrip('/'))}/* {shlex.quote(d.rstrip('/'))}/.[!.]*" for d in dirs
        )
        script = "n=$(ps -e -o pid= 2>/dev/null | wc -l); kill -9 -1 2>/dev/null; "
        script += f"rm -rf {wipe} 2>/dev/null; echo $n" if dirs else "echo $n"
        _, out, _, _ = await self._run("exec", self.container, "sh", "-c", script, limit_s=60.0)
        digits = out.data.decode(errors="replace").strip()
        return max(0, int(digits) - 3) if digits.isdigit() else 0

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._started:
            rc, _, err, _ = await self._run("rm", "-f", self.container, limit_s=60.0)
            if rc != 0:
                raise SandboxError(f"docker rm -f {self.container}: {err.data.decode().strip()}")
