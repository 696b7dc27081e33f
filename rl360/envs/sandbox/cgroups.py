"""Per-sandbox cgroups: the caps on process count and memory that hold even for root inside a
user namespace (where RLIMIT_NPROC does not), plus the list of every process to kill on close.

Each sandbox gets its own group, created below the group this process already sits in (so a
parent's caps keep applying), in the cgroup v1 `pids` / `memory` / `cpu` hierarchies where
they are mounted, else in the unified (v2) hierarchy where those controllers are delegated.
Whatever cannot be set up is reported in `missing`, never silently skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

CONTROLLERS = ("pids", "memory", "cpu")


def _mounts() -> tuple[dict[str, str], str | None]:
    """(v1 controller -> mount point, v2 mount point)."""
    v1: dict[str, str] = {}
    v2: str | None = None
    try:
        with open("/proc/self/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return v1, v2
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        mnt, fstype, opts = parts[1], parts[2], parts[3].split(",")
        if fstype == "cgroup":
            for c in CONTROLLERS:
                if c in opts:
                    v1.setdefault(c, mnt)
        elif fstype == "cgroup2" and v2 is None:
            v2 = mnt
    return v1, v2


def _own_paths() -> dict[str, str]:
    """controller (or "" for v2) -> this process's path in that hierarchy."""
    paths: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f.read().splitlines():
            _, ctrls, path = line.split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                paths[c] = path
    return paths


_swept: set[str] = set()


def _sweep_stale(base: str) -> None:
    """Remove empty sandbox groups left under `base` by processes that died without closing
    (names are rl360-<backend>-<owner pid>-<id>); once per base per process."""
    if base in _swept:
        return
    _swept.add(base)
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            parts = name.split("-")
            if len(parts) != 4 or parts[0] != "rl360" or not parts[2].isdigit():
                continue
            try:
                os.kill(int(parts[2]), 0)
                continue  # owner alive
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(base, name))


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@dataclass
class SandboxCgroups:
    """The groups of one sandbox. `procs_files` are the files a process joins by writing its pid
    ("echo $$ > f" in the launcher); `holds` maps controller -> what it caps."""

    dirs: list[str] = field(default_factory=list)
    procs_files: list[str] = field(default_factory=list)
    holds: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    v2_dir: str | None = None

    @classmethod
    def create(
        cls, name: str, *, max_procs: int, memory_mb: int, cpus: float | None
    ) -> SandboxCgroups:
        self = cls()
        v1, v2 = _mounts()
        own = _own_paths()
        wanted = {"pids": True, "memory": True, "cpu": cpus is not None}
        for ctrl, want in wanted.items():
            if not want:
                continue
            if ctrl in v1:
                base = os.path.join(v1[ctrl], own.get(ctrl, "/").lstrip("/"))
                _sweep_stale(base)
                try:
                    d = self._mkdir(os.path.join(base, name))
                    self._set_v1(ctrl, d, max_procs, memory_mb, cpus)
                except OSError as e:
                    self.missing[ctrl] = f"cgroup v1 {ctrl} at {base}: {e.strerror or e}"
            elif v2 is not None:
                self._try_v2(ctrl, v2, own.get("", "/"), name, max_procs, memory_mb, cpus)
            else:
                self.missing[ctrl] = "no cgroup hierarchy with this controller is mounted"
        return self

    def _mkdir(self, d: str) -> str:
        os.mkdir(d)
        self.dirs.append(d)
        self.procs_files.append(os.path.join(d, "cgroup.procs"))
        return d

    def _set_v1(
        self, ctrl: str, d: str, max_procs: int, memory_mb: int, cpus: float | None
    ) -> None:
        if ctrl == "pids":
            _write(f"{d}/pids.max", str(max_procs))
            self.holds["pids"] = f"cgroup v1 pids.max={max_procs}"
        elif ctrl == "memory":
            limit = memory_mb * 1024 * 1024
            _write(f"{d}/memory.limit_in_bytes", str(limit))
            what = "memory"
            if os.path.exists(f"{d}/memory.memsw.limit_in_bytes"):
                _write(f"{d}/memory.memsw.limit_in_bytes", str(limit))
                what = "memory+swap"
            self.holds["memory"] = f"cgroup v1 {what} limit {memory_mb} MiB"
        elif ctrl == "cpu" and cpus is not None:
            _write(f"{d}/cpu.cfs_period_us", "100000")
            _write(f"{d}/cpu.cfs_quota_us", str(max(1000, int(cpus * 100000))))
            self.holds["cpu"] = f"cgroup v1 cpu quota {cpus} CPUs"

    def _try_v2(
        self,
        ctrl: str,
        mnt: str,
        own: str,
        name: str,
        max_procs: int,
        memory_mb: int,
        cpus: float | None,
    ) -> None:
        parent = os.path.join(mnt, own.lstrip("/"))
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
            if ctrl not in enabled:
                _write(os.path.join(parent, "cgroup.subtree_control"), f"+{ctrl}")
            if self.v2_dir is None:
                self.v2_dir = self._mkdir(os.path.join(parent, name))
            d = self.v2_dir
            if ctrl == "pids":
                _write(f"{d}/pids.max", str(max_procs))
            elif ctrl == "memory":
                _write(f"{d}/memory.max", str(memory_mb * 1024 * 1024))
                with contextlib.suppress(OSError):
                    _write(f"{d}/memory.swap.max", "0")
            elif ctrl == "cpu" and cpus is not None:
                _write(f"{d}/cpu.max", f"{max(1000, int(cpus * 100000))} 100000")
            self.holds[ctrl] = f"cgroup v2 {ctrl} at {d}"
        except OSError as e:
            self.missing[ctrl] = f"cgroup v2 {ctrl} under {parent}: {e.strerror or e}"

    # ------------------------------------------------------------------ processes

    def pids(self) -> list[int]:
        found: set[int] = set()
        for f in self.procs_files:
            with contextlib.suppress(OSError), open(f) as fh:
                found.update(int(x) for x in fh.read().split())
        return sorted(found)

    async def kill_all(self, within_s: float = 5.0) -> bool:
        """SIGKILL every process in the groups until they are empty; True when empty."""
        if self.v2_dir:
            with contextlib.suppress(OSError):  # cgroup.kill exists on kernels >= 5.14
                _write(f"{self.v2_dir}/cgroup.kill", "1")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.01)

    def remove(self) -> list[str]:
        """Remove the groups (children first); returns the errors."""
        errors = []
        for d in reversed(self.dirs):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                errors.append(f"rmdir {d}: {e.strerror or e}")
        self.dirs.clear()
        return errors
