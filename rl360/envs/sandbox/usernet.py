"""Outbound network for a `network = true` bwrap sandbox without the host's network namespace.

The sandbox keeps its own network namespace; slirp4netns (a user-mode TCP/IP stack) gives it a
tap device whose traffic leaves through ordinary sockets of the host, with the host's loopback
switched off (--disable-host-loopback). Inside the namespace, routes make loopback-like,
link-local and private ranges unreachable, as well as every address of the host itself (a
service bound to 0.0.0.0 is reachable at the host's own address otherwise): the sandbox reaches
the public network and nothing of the cluster. The sandbox cannot change those routes (it has
no capabilities in its namespaces).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import os
import shutil
import signal
import subprocess

SLIRP_CIDR = "10.0.2.0/24"  # slirp4netns's default: gateway .2, DNS .3, the sandbox .100
SLIRP_DNS = "10.0.2.3"
BLOCKED_CIDRS = (
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "224.0.0.0/4",
    "240.0.0.0/4",
)
READY_TIMEOUT_S = 20.0
NS_GET_USERNS = 0xB701  # ioctl: the user namespace owning a namespace


def usernet_unavailable() -> str | None:
    """Why a network=true sandbox cannot get its own outbound network here, or None."""
    missing = [t for t in ("slirp4netns", "nsenter", "ip") if shutil.which(t) is None]
    if missing:
        return (
            f"network = true needs {', '.join(missing)} (apt-get install slirp4netns iproute2 "
            "util-linux); refused rather than sharing the host's network namespace"
        )
    return None


def host_addresses() -> list[str]:
    """Every IPv4 address of this host (its own interfaces)."""
    try:
        out = subprocess.run(
            ["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    addrs = []
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            addrs.append(parts[parts.index("inet") + 1].split("/")[0])
    return addrs


def route_batch(host_addrs: list[str]) -> str:
    """`ip -batch` lines that make the blocked ranges and the host's own addresses unreachable
    (the slirp /24 stays reachable: its connected route is more specific)."""
    lines = [f"route add unreachable {c}" for c in BLOCKED_CIDRS]
    slirp = ipaddress.ip_network(SLIRP_CIDR)
    for a in host_addrs:
        ip = ipaddress.ip_address(a)
        if ip not in slirp and not ip.is_loopback:
            lines.append(f"route add unreachable {a}/32")
    return "\n".join(lines) + "\n"


def child_pid(launcher_pid: int) -> int:
    """The pid of bwrap's child (the process inside the sandbox's namespaces)."""
    with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children") as f:
        kids = f.read().split()
    if not kids:
        raise RuntimeError(f"bwrap (pid {launcher_pid}) has no child")
    return int(kids[0])


class UserNet:
    """slirp4netns attached to one sandbox's network namespace."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None

    async def attach(self, pid: int) -> None:
        # the user namespace that OWNS the network namespace: bwrap --disable-userns puts the
        # sandbox's processes one user namespace deeper, where joining the netns is refused
        netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            owner = fcntl.ioctl(netns, NS_GET_USERNS)
        finally:
            os.close(netns)
        try:
            await self._attach(pid, owner)
        finally:
            os.close(owner)

    async def _attach(self, pid: int, owner: int) -> None:
        rfd, wfd = os.pipe()
        try:
            argv = [
                shutil.which("slirp4netns") or "slirp4netns",
                "--configure",
                "--mtu=65520",
                "--disable-host-loopback",
                f"--ready-fd={wfd}",
                f"--userns-path=/proc/self/fd/{owner}",
                str(pid),
                "tap0",
            ]
            self.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(wfd, owner),
                start_new_session=True,
            )
            os.close(wfd)
            wfd = -1
            ready = await asyncio.wait_for(asyncio.to_thread(os.read, rfd, 1), READY_TIMEOUT_S)
            if ready != b"1":
                err = b""
                if self.proc.stderr is not None:
                    with contextlib.suppress(TimeoutError):
                        err = await asyncio.wait_for(self.proc.stderr.read(2000), 2.0)
                raise RuntimeError(f"slirp4netns failed: {err.decode(errors='replace').strip()}")
        finally:
            os.close(rfd)
            if wfd >= 0:
                os.close(wfd)
        enter = [shutil.which("nsenter") or "nsenter", f"--net=/proc/{pid}/ns/net"]
        if os.geteuid() != 0:  # rootless: the owner namespace grants CAP_NET_ADMIN there
            enter += [f"--user=/proc/self/fd/{owner}", "--preserve-credentials"]
        routes = await asyncio.create_subprocess_exec(
            *enter,
            "ip",
            "-batch",
            "-",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=(owner,),
        )
        batch = route_batch(await asyncio.to_thread(host_addresses))
        _, err = await asyncio.wait_for(routes.communicate(batch.encode()), READY_TIMEOUT_S)
        if routes.returncode != 0:
            raise RuntimeError(f"could not block private ranges: {err.decode().strip()}")

    async def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 5.0)
