"""bwrap hardening: never host root, no nested user namespaces, no path to the host's loopback,
and the protections a sandbox lacks are reported, never silently dropped."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from rl360.envs.agent import ScriptedClient, run_episode
from rl360.envs.code import CodeEnv
from rl360.envs.sandbox import SandboxStartError, cgroups
from rl360.envs.sandbox.bwrap import SANDBOX_UID
from rl360.types import Message, Task

pytestmark = pytest.mark.timeout(120)


def _host_uid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[2])  # effective uid
    except OSError:
        return None
    return None


async def test_sandbox_user_is_never_host_root(bwrap_backend, make_sandbox):
    sb = make_sandbox(bwrap_backend)
    res = await sb.exec("sleep 30 & echo $!; id -u", timeout=20)
    assert res.stdout.split()[-1] == str(SANDBOX_UID)
    pids = await sb.host_pids()
    uids = {_host_uid(p) for p in pids} - {None}
    assert uids, pids
    assert 0 not in uids, f"sandbox processes run as host uids {uids}"


async def test_no_nested_user_namespaces(bwrap_backend, make_sandbox):
    sb = make_sandbox(bwrap_backend)
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "rc = libc.unshare(0x10000000)  # CLONE_NEWUSER\n"
        "print('NESTED' if rc == 0 else 'refused %d' % ctypes.get_errno())"
    )
    res = await sb.exec(["python3", "-I", "-S", "-c", code], timeout=20)
    assert "refused" in res.stdout, res
    res = await sb.exec("unshare -U -r id -u 2>&1 || echo refused", timeout=20)
    assert "refused" in res.stdout or "Operation not permitted" in res.stdout, res


@contextlib.asynccontextmanager
async def _loopback_service():
    """A TCP service on the host's loopback that records whether anyone connected."""
    hits: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hits.append(b"connected")
        writer.write(b"HOST-SECRET\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, family=socket.AF_INET)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port, hits
    finally:
        server.close()
        await server.wait_closed()


PROBE = """
import socket, sys
port = int(sys.argv[1])
for host in ("127.0.0.1", "10.0.2.2", "10.0.2.3", "169.254.169.254", "172.17.0.1", "192.168.0.1"):
    try:
        s = socket.create_connection((host, port), timeout=2)
        print("REACHED", host, s.recv(64))
    except OSError as e:
        print("blocked", host, type(e).__name__)
"""


@pytest.mark.parametrize("network", [False, True], ids=["no-network", "network"])
async def test_sandbox_cannot_reach_host_loopback(bwrap_backend, make_sandbox, network):
    """A network=true sandbox (its own netns through a user-mode stack, or refused where none
    exists) cannot reach a service on the host's loopback; nor can a network=false one."""
    async with _loopback_service() as (port, hits):
        sb = make_sandbox(bwrap_backend, network=network)
        try:
            await sb.start()
        except SandboxStartError as e:
            assert network and "network" in str(e)  # refused with a one-line reason
            return
        res = await sb.exec(["python3", "-I", "-S", "-c", PROBE, str(port)], timeout=60)
        assert "REACHED" not in res.stdout, res
        assert not hits
        if network:
            assert "slirp4netns" in sb.protections.network
            routes = await sb.exec("ip route 2>/dev/null; ip route del 10.0.0.0/8 2>&1", timeout=20)
            assert "unreachable 10.0.0.0/8" in routes.stdout
            assert "not permitted" in routes.stdout.lower()  # the sandbox cannot lift them


async def test_missing_protections_are_reported(bwrap_backend, make_sandbox, monkeypatch):
    """Without cgroups, memory falls back to RLIMIT_AS (it holds) and the process cap is
    reported missing: in protections, which run_episode copies into the episode's counters."""
    real = cgroups.SandboxCgroups.create

    def no_cgroups(*args, **kwargs):
        cg = real(*args, **kwargs)
        cg.holds.clear()
        cg.missing.update({"pids": "test: no cgroup", "memory": "test: no cgroup"})
        return cg

    monkeypatch.setattr(cgroups.SandboxCgroups, "create", staticmethod(no_cgroups))
    sb = make_sandbox(bwrap_backend, memory_mb=64)
    await sb.start()
    assert "RLIMIT_AS" in sb.protections.memory
    assert "procs" in sb.protections.missing()
    res = await sb.exec(
        ["python3", "-I", "-S", "-c", "x = bytearray(512 << 20); print('allocated')"], timeout=20
    )
    assert "allocated" not in res.stdout and res.exit_code != 0
    task = Task(id="t", prompt="p", data={"tests": ["assert True"]})
    client = ScriptedClient([Message(role="assistant", content="x = 1")])
    out = await run_episode(CodeEnv(), task, sb, client)
    assert out.counters.get("sandbox_missing_procs") == 1
