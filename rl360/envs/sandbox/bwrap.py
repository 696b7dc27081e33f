"""The bubblewrap sandbox (default on Linux).

One bwrap per sandbox runs the exec server (as the pid namespace's init, so sandboxed code
cannot kill it) as uid 65534 with no capabilities, in fresh user,
pid, ipc, uts, cgroup and network namespaces; network = true adds outbound access through
slirp4netns with private ranges and the host blocked (usernet.py), or is refused where
slirp4netns is missing. It sees the system dirs and
the interpreter's prefix read-only, a RAM-backed work dir and /tmp capped by size, and a
read-only root. A per-sandbox cgroup caps process count and memory (RLIMIT_NPROC does not hold
inside a user namespace); each exec'd process gets RLIMIT_CPU. Closing kills bwrap, whose pid
namespace takes every sandbox process with it, then sweeps the cgroup until it is empty.

When this host process is root, bwrap's uid 65534 would map to host root (bwrap maps the
caller's uid), so the launcher always drops to host uid 65534 with setpriv first (no setpriv:
the sandbox refuses to start). An interpreter that uid cannot reach (under /root) is replaced by
a world-readable one (interp.sandbox_python); other binds it cannot reach refuse to start. Nested user namespaces are
disabled (--disable-userns). Without a memory cgroup each process gets RLIMIT_AS instead;
without a pids cgroup there is no process cap (RLIMIT_NPROC would count the whole host uid):
both are reported in `protections` (and so in the run's metrics and `rl360 preflight`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence

from rl360.envs.sandbox.base import SandboxError, SandboxLimits, SandboxStartError
from rl360.envs.sandbox.cgroups import SandboxCgroups
from rl360.envs.sandbox.channel import server_argv
from rl360.envs.sandbox.interp import reachable_by_others, sandbox_python
from rl360.envs.sandbox.served import ServedSandbox, warn_once
from rl360.envs.sandbox.usernet import SLIRP_DNS, UserNet, child_pid, usernet_unavailable

log = logging.getLogger(__name__)

SANDBOX_UID = 65534
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = (
    "passwd",
    "group",
    "nsswitch.conf",
    "hosts",
    "host.conf",
    "localtime",
    "timezone",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "ssl/certs",
    "ca-certificates",
    "mime.types",
    "os-release",
    "protocols",
    "services",
    "gai.conf",
    "bash.bashrc",
    "profile",
    "inputrc",
)
# /proc entries made read-only or hidden, as Docker does. bwrap covers some itself but skips
# /proc/sys (it tests the directory, not its files), where a root-mapped sandbox could otherwise
# write host-wide sysctls such as vm/drop_caches.
PROC_READONLY = ("sys", "sysrq-trigger", "fs", "bus", "irq")
PROC_MASKED = ("kcore", "keys", "timer_list", "sched_debug", "latency_stats", "kallsyms")
FORBIDDEN_WORKDIRS = ("/", "/usr", "/etc", "/proc", "/dev", "/tmp", "/bin", "/lib", "/sys")
# processes the sandbox itself adds to the pids count: bwrap's monitor, the exec server, its
# warm template and, during a warm exec, the template's short-lived middle process
BWRAP_OVERHEAD_PROCS = 4
INSIDE_EXIT_S = 5.0  # closing: how long bwrap may take to exit once the sandbox's init is killed


@functools.cache
def bwrap_unavailable() -> str | None:
    """None when bubblewrap can build our namespaces here, else why not."""
    exe = shutil.which("bwrap")
    if exe is None:
        return "bubblewrap (bwrap) is not installed (apt-get install bubblewrap)"
    probe = [
        exe,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--size",
        "1048576",
        "--tmpfs",
        "/tmp",
        "--die-with-parent",
        "--",
        "/bin/true",
    ]
    try:
        out = subprocess.run(probe, capture_output=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap failed to run: {e}"
    if out.returncode != 0:
        return f"bwrap cannot create namespaces here: {out.stderr.decode(errors='replace').strip()}"
    return None


def _system_binds() -> list[str]:
    args: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for name in ETC_FILES:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return args


class BwrapSandbox(ServedSandbox):
    backend = "bwrap"

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        workdir: str | None = None,
        *,
        scratch_dirs: Sequence[str] = (),
        ro_binds: Sequence[str] = (),
        python: str | None = None,
    ) -> None:
        super().__init__(limits, workdir)
        for d in (self.workdir, *scratch_dirs):
            if not os.path.isabs(d) or os.path.normpath(d) in FORBIDDEN_WORKDIRS:
                raise ValueError(
                    f"bwrap sandbox: {d!r} cannot be a writable dir (absolute, not a system dir)"
                )
        self.scratch_dirs = [os.path.normpath(d) for d in scratch_dirs]
        self.ro_binds = [os.path.realpath(p) for p in ro_binds]
        self.python = sandbox_python(python)
        self._cg: SandboxCgroups | None = None
        self._resolv: str | None = None  # a host file bound as /etc/resolv.conf (network only)
        self._net: UserNet | None = None

    def _binds(self) -> list[str]:
        return [
            p
            for p in (self.python.prefix, *self.ro_binds)
            if p != "/usr" and not p.startswith("/usr/")
        ]

    def clean_env(self) -> dict[str, str]:
        return {"PATH": f"{self.python.bin_dir}:/usr/local/bin:/usr/bin:/bin", "TMPDIR": "/tmp",
                "LANG": "C.UTF-8", "USER": "sandbox"}

    def _bwrap_argv(self, drop_uid: bool) -> list[str]:
        lim = self.limits
        mib = 1024 * 1024
        args = [
            shutil.which("bwrap") or "bwrap",
            "--unshare-user",
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
            "--unshare-pid",
            "--as-pid-1",  # the exec server is the namespace's init: unkillable from inside
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--hostname",
            "sandbox",
            "--die-with-parent",
            # no --new-session: ServedSandbox.start runs bwrap in a session of its own already
            # (no controlling terminal inside to push keystrokes into), and a second session
            # would be a scheduler autogroup of its own at full weight (served.nice_autogroup)
            "--cap-drop",
            "ALL",
            "--disable-userns",  # no nested user namespaces (a way to regain capabilities)
        ]
        args.append("--unshare-net")  # always: the host's network namespace is never shared
        args += _system_binds()
        for p in self._binds():
            args += ["--ro-bind", p, p]
        if self._resolv is not None:  # network = true: DNS through slirp4netns
            args += ["--ro-bind", self._resolv, "/etc/resolv.conf"]
        args += ["--dev", "/dev", "--proc", "/proc"]
        for name in PROC_READONLY:
            args += ["--ro-bind-try", f"/proc/{name}", f"/proc/{name}"]
        for name in PROC_MASKED:
            if os.path.exists(f"/proc/{name}"):
                args += ["--ro-bind", "/dev/null", f"/proc/{name}"]
        args += ["--size", str(lim.tmp_mb * mib), "--tmpfs", "/tmp"]
        args += ["--size", str(lim.tmp_mb * mib), "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
        for d in (self.workdir, *self.scratch_dirs):
            args += ["--size", str(lim.disk_mb * mib), "--tmpfs", d]
        args += ["--remount-ro", "/", "--chdir", self.workdir, "--clearenv"]
        env = {**self.clean_env(), "HOME": self.workdir, "PYTHONDONTWRITEBYTECODE": "1"}
        for k, v in env.items():
            args += ["--setenv", k, v]
        rlimits = {"RLIMIT_CPU": lim.cpu_seconds, "RLIMIT_CORE": 0}
        if self._cg is not None and "memory" not in self._cg.holds:  # no cgroup: per process
            rlimits["RLIMIT_AS"] = (lim.memory_mb + 256) * mib
        config = {"workdir": self.workdir, "rlimits": rlimits}
        args += ["--", *server_argv(self.python.executable, config)]
        if drop_uid:
            args = [
                shutil.which("setpriv") or "setpriv",
                f"--reuid={SANDBOX_UID}",
                f"--regid={SANDBOX_UID}",
                "--clear-groups",
                *args,
            ]
        return args

    async def _prepare(self) -> tuple[list[str], dict[str, str], str | None]:
        lim = self.limits
        if lim.network:
            why = usernet_unavailable()
            if why:
                raise SandboxStartError(f"bwrap sandbox: {why}")
            fd, self._resolv = tempfile.mkstemp(prefix="rl360-resolv-", suffix=".conf")
            with os.fdopen(fd, "w") as f:
                f.write(f"nameserver {SLIRP_DNS}\n")
            os.chmod(self._resolv, 0o644)
        self._cg = SandboxCgroups.create(
            self.sandbox_id,
            max_procs=lim.max_procs + BWRAP_OVERHEAD_PROCS,
            memory_mb=lim.memory_mb,
            cpus=lim.cpus,
        )
        drop_uid = os.geteuid() == 0
        if drop_uid:
            if shutil.which("setpriv") is None:
                raise SandboxStartError(
                    "bwrap sandbox: running as root needs setpriv (util-linux) to drop to uid "
                    f"{SANDBOX_UID}; refusing to map the sandbox user to host root"
                )
            unreachable = [p for p in self._binds() if not reachable_by_others(p)]
            if unreachable:
                raise SandboxStartError(
                    f"bwrap sandbox: {unreachable} not readable by uid {SANDBOX_UID}; "
                    "make it world-readable (the sandbox never runs as host root)"
                )
        argv = self._bwrap_argv(drop_uid)
        if self._cg.procs_files:
            joins = " && ".join(f"echo $$ > {shlex.quote(f)}" for f in self._cg.procs_files)
            argv = ["/bin/sh", "-c", f'{joins} && exec "$@"', "rl360-sandbox", *argv]
        self._set_protections(drop_uid)
        return argv, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, "/"

    def _set_protections(self, drop_uid: bool) -> None:
        lim, cg = self.limits, self._cg
        assert cg is not None
        p = self.protections
        host_uid = SANDBOX_UID if drop_uid else os.geteuid()
        p.network = (
            "own network namespace, outbound through slirp4netns; host loopback, link-local, "
            "private ranges and the host's own addresses unreachable"
            if lim.network
            else "empty network namespace (bwrap --unshare-net)"
        )
        p.filesystem = (
            f"only system dirs and the interpreter, read-only; uid {SANDBOX_UID} "
            f"(host uid {host_uid}), no capabilities"
        )
        p.procs = cg.holds.get("pids", "")  # RLIMIT_NPROC counts the whole host uid: no use
        p.memory = cg.holds.get("memory", "") or (
            f"RLIMIT_AS {lim.memory_mb + 256} MiB per process (no memory cgroup: not the "
            "sandbox total)"
        )
        p.cpu = f"RLIMIT_CPU {lim.cpu_seconds}s per process" + (
            f", {cg.holds['cpu']}" if "cpu" in cg.holds else ""
        )
        p.disk = (
            f"tmpfs work dir {lim.disk_mb} MiB, /tmp and /dev/shm {lim.tmp_mb} MiB each, "
            "read-only root and /dev"
        )
        p.cleanup = "pid namespace dies with bwrap" + (", cgroup swept empty" if cg.dirs else "")
        p.helper = (
            "exec server is the pid namespace's init (signals from inside dropped), no ptrace"
        )
        for ctrl, why in cg.missing.items():
            warn_once(f"bwrap sandbox: no {ctrl} cap ({why})")

    async def _after_ready(self) -> None:
        if not self.limits.network:
            return
        assert self._proc is not None
        self._net = UserNet()
        await self._net.attach(child_pid(self._proc.pid))

    async def _stop_inside(self, proc: asyncio.subprocess.Process) -> None:
        """SIGKILL the sandbox's init (the exec server, pid 1 of its namespace): the kernel
        kills and reaps everything else inside, and bwrap, its parent, reaps it and exits. Only
        then is bwrap gone; killing both at once left the init to the host's init to reap."""
        try:
            inner = child_pid(proc.pid)
        except (OSError, RuntimeError, ValueError):
            return  # the launcher is gone, or bwrap never forked
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(inner, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), INSIDE_EXIT_S)

    async def _teardown(self) -> None:
        if self._net is not None:
            await self._net.close()
            self._net = None
        if self._resolv is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._resolv)
            self._resolv = None
        cg, self._cg = self._cg, None
        if cg is None:
            return
        if not await cg.kill_all():
            log.error("%s: processes left in its cgroup after kill: %s", self.sandbox_id, cg.pids())
        for err in cg.remove():
            log.error("%s: %s", self.sandbox_id, err)

    async def sweep(self, dirs: Sequence[str] = ()) -> int:
        self._check_open()
        await self.start()
        res = await self._channel().sweep(dirs)
        if not res.get("swept"):
            raise SandboxError(f"{self.sandbox_id}: the exec server is not its namespace's init")
        return int(res.get("killed", 0))

    async def host_pids(self) -> list[int]:
        return self._cg.pids() if self._cg is not None else []
