"""The Docker sandbox, for hosts with a running Docker engine (and tasks with their own image).

One container per sandbox (`docker run -d ... sleep infinity`, sleep as pid 1) with capped
memory, pids and CPUs, a read-only root, size-capped tmpfs /tmp, no capabilities and
no-new-privileges; each exec is a `docker exec`. The docker CLI is driven via subprocess (no
SDK). On a timeout every process of the container except its init is killed (docker exec
gives no handle on the exec'd process tree); close removes the container and its volumes.

Network: none, or with `limits.network` the bridge network `rl360-egress` (created once):
outbound only, no traffic between containers (icc off), never the host's network namespace.
The host's own addresses and private ranges stay reachable through it (Docker sets no firewall
rule against them): `protections.network` says so.

Images: the stock Python image (uid 65534, a size-capped tmpfs work dir), a task's image, or a
task's environment/Dockerfile built once per content (`build_context`: the image is tagged
`rl360-task:<sha256 of the context's files>`, so an unchanged context is never built twice and
a changed one never reuses a stale image). A task's image runs as its own user (its files are
its own; no capabilities, no new privileges) with the work dir an anonymous volume that Docker
fills from the image's own files there: no size cap, listed as a missing disk protection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

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
EGRESS_NETWORK = "rl360-egress"
BUILD_TIMEOUT_S = 1800.0
TASK_IMAGE = "rl360-task"
_builds: dict[str, asyncio.Lock] = {}  # one build at a time per image tag in this process


@functools.cache
def docker_unavailable() -> str | None:
    exe = shutil.which("docker")
    if exe is None:
        return "no Docker engine: the docker CLI is not installed"
    try:
        out = subprocess.run(
            [exe, "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no Docker engine: docker info failed: {e}"
    if out.returncode != 0:
        why = " ".join(out.stderr.decode(errors="replace").split())[:200]
        return f"no Docker engine: {why}"
    return None


def context_digest(context: str | os.PathLike[str]) -> str:
    """sha256 over a build context's files (relative path, mode's exec bit, bytes), sorted."""
    root = Path(context)
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() or p.is_symlink():
            rel = p.relative_to(root).as_posix().encode()
            data = os.readlink(p).encode() if p.is_symlink() else p.read_bytes()
            execbit = b"x" if not p.is_symlink() and p.stat().st_mode & 0o111 else b"-"
            h.update(len(rel).to_bytes(4, "big") + rel + execbit)
            h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


def task_image_tag(context: str | os.PathLike[str]) -> str:
    return f"{TASK_IMAGE}:{context_digest(context)[:24]}"


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
        build_context: str | None = None,
    ) -> None:
        super().__init__(limits, workdir)
        if image and build_context:
            raise ValueError("docker sandbox: give an image or a build context, not both")
        self.build_context = build_context
        self.image = image or DEFAULT_IMAGE
        self.own_image = bool(image or build_context)  # the task's: its user, its files
        self.scratch_dirs = list(scratch_dirs)
        self.user = None if self.own_image else user
        self.container = f"rl360-{uuid.uuid4().hex[:12]}"
        self._docker = shutil.which("docker") or "docker"
        self._env: dict[str, str] = {}

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

    async def build_image(self, context: str) -> str:
        """The tag of `context`'s image, built unless an image of that content exists."""
        tag = await asyncio.to_thread(task_image_tag, context)
        async with _builds.setdefault(tag, asyncio.Lock()):
            rc, _, _, _ = await self._run("image", "inspect", tag, limit_s=60.0)
            if rc == 0:
                return tag
            rc, out, err, timed_out = await self._run(
                "build", "-t", tag, context, limit_s=BUILD_TIMEOUT_S, cap=1 << 20)
            if rc != 0 or timed_out:
                tail = (out.data + err.data).decode(errors="replace").strip()[-800:]
                why = f"timed out after {BUILD_TIMEOUT_S:g}s" if timed_out else f"exit {rc}"
                raise SandboxStartError(f"docker build of {context} failed ({why}): {tail}")
            return tag

    async def _egress_network(self) -> str:
        """The outbound-only bridge network (created once per engine; icc off)."""
        rc, _, _, _ = await self._run("network", "inspect", EGRESS_NETWORK, limit_s=30.0)
        if rc != 0:
            rc, _, err, _ = await self._run(
                "network", "create", "--driver", "bridge",
                "-o", "com.docker.network.bridge.enable_icc=false", EGRESS_NETWORK, limit_s=60.0)
            text = err.data.decode(errors="replace")
            if rc != 0 and "already exists" not in text:
                raise SandboxStartError(f"docker network create {EGRESS_NETWORK}: {text.strip()}")
        return EGRESS_NETWORK

    async def _image_env(self) -> dict[str, str]:
        rc, out, _, _ = await self._run("image", "inspect", "--format", "{{json .Config.Env}}",
                                        self.image, limit_s=60.0)
        env: dict[str, str] = {}
        if rc == 0:
            with contextlib.suppress(ValueError, TypeError):
                for item in json.loads(out.data.decode()) or []:
                    k, _, v = str(item).partition("=")
                    env[k] = v
        return env

    def clean_env(self) -> dict[str, str]:
        return {**super().clean_env(), **{k: v for k, v in self._env.items()
                                          if k in ("PATH", "LANG", "LC_ALL")}}

    async def start(self) -> None:
        if self._started:
            return
        self._check_open()
        if self.build_context is not None:
            try:
                self.image = await self.build_image(self.build_context)
            except SandboxStartError:
                self._closed = True
                raise
        lim, mib = self.limits, 1024 * 1024
        try:
            network = await self._egress_network() if lim.network else "none"
        except SandboxStartError:
            self._closed = True
            raise
        args = [
            "run",
            "-d",
            "--rm",
            "--name",
            self.container,
            "--network",
            network,
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
            # the task's image: its own files in the work dir (a volume Docker fills from them)
            *(["--mount", f"type=volume,dst={self.workdir}"] if self.own_image else
              ["--tmpfs", f"{self.workdir}:rw,exec,size={lim.disk_mb * mib},mode=1777"]),
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
        self._env = await self._image_env()
        p = self.protections
        p.network = (f"bridge {EGRESS_NETWORK}: outbound only, no inter-container traffic; the "
                     "host's addresses and private ranges reachable" if lim.network
                     else "--network none")
        who = "the image's own user" if self.own_image else f"uid {self.user}"
        p.filesystem = f"container image, read-only root, {who}, --cap-drop ALL, no-new-privileges"
        p.procs, p.memory = f"--pids-limit {lim.max_procs}", f"--memory {lim.memory_mb}m"
        p.cpu = f"--ulimit cpu={lim.cpu_seconds}"
        p.disk = "" if self.own_image else f"tmpfs work dir {lim.disk_mb} MiB"
        p.cleanup = "docker rm -f -v"
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
            rc, _, err, _ = await self._run("rm", "-f", "-v", self.container, limit_s=60.0)
            if rc != 0:
                raise SandboxError(f"docker rm -f -v {self.container}: "
                                   f"{err.data.decode().strip()}")
