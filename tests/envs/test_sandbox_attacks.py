"""One test per attack: the attack fails inside the sandbox AND the host keeps going (a fresh
sandbox still runs a normal command). An attack on a protection the process backend does not
have runs on bwrap only; that the process backend reports those protections missing is a test
of its own (never a pass, never a skip)."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.timeout(60)
# attacks on what the process backend lacks (it runs code as the host user, on the host)
BWRAP_ONLY = pytest.mark.parametrize("backend", ["bwrap"], indirect=True)
PROCESS_GAPS = ["network", "filesystem", "procs", "disk", "helper"]


def _exists(path: str | Path) -> bool:
    return os.path.exists(path)


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@BWRAP_ONLY
async def test_fork_bomb(backend, make_sandbox, require, fresh_ok, wait_until):
    sb = make_sandbox(backend, max_procs=24, timeout=5)
    await sb.start()
    require(sb, "procs")
    res = await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 1; echo parent-alive", timeout=4)
    assert "Cannot fork" in res.stderr or "fork" in res.stderr.lower()
    assert len(await sb.host_pids()) <= 24 + 2  # the cap held (+ bwrap and the exec server)
    pids = await sb.host_pids()
    await sb.close()
    gone = await wait_until(lambda: not [p for p in pids if _alive(p)])
    assert gone, "fork bomb processes survived close"
    await fresh_ok(backend)


async def test_memory_bomb(backend, make_sandbox, require, fresh_ok):
    sb = make_sandbox(backend, memory_mb=128, timeout=10)
    await sb.start()
    require(sb, "memory")
    bomb = (
        "x = []\nfor _ in range(64):\n    x.append(bytearray(32 * 2**20))\nprint('allocated 2 GiB')"
    )
    res = await sb.exec(["python3", "-I", "-S", "-c", bomb], timeout=10)
    assert res.exit_code != 0, res
    assert "allocated" not in res.stdout
    # the sandbox itself survives the OOM kill of its process
    again = await sb.exec(["python3", "-I", "-S", "-c", "print('still here')"], timeout=10)
    assert again.ok and "still here" in again.stdout, again
    await fresh_ok(backend)


async def test_infinite_loop_cpu_limit(backend, make_sandbox, require, fresh_ok):
    sb = make_sandbox(backend, cpu_seconds=1, timeout=20)
    await sb.start()
    require(sb, "cpu")
    res = await sb.exec(["python3", "-I", "-S", "-c", "while True: pass"], timeout=20)
    # RLIMIT_CPU, not the 20 s wall clock, stopped it: SIGXCPU (or SIGKILL at the hard limit)
    assert not res.timed_out, "RLIMIT_CPU did not stop the loop"
    assert res.exit_code in (-24, -9), res
    await fresh_ok(backend)


async def test_wall_timeout_kills_process_tree(backend, make_sandbox, fresh_ok, wait_until):
    sb = make_sandbox(backend, timeout=20)
    await sb.start()
    before = set(await sb.host_pids())
    res = await sb.exec("sleep 30 & sleep 31 & sleep 32; echo never", timeout=1)
    assert res.timed_out and res.exit_code == -9
    assert "never" not in res.stdout

    async def only_before() -> bool:
        return set(await sb.host_pids()) <= before

    assert await wait_until(only_before), "the timed-out command's children survived"
    await fresh_ok(backend)


@BWRAP_ONLY
async def test_write_gigabytes(backend, make_sandbox, require, fresh_ok):
    sb = make_sandbox(backend, disk_mb=32, tmp_mb=16, memory_mb=512, timeout=20)
    await sb.start()
    require(sb, "disk")
    writer = (
        "import sys\nblock = b'x' * 2**20\nn = 0\ntry:\n"
        "    for i in range(64):\n        with open(f'{sys.argv[1]}/f{i}', 'wb') as f:\n"
        "            for _ in range(32):\n                f.write(block); n += 1\n"
        "except OSError as e:\n    print('stopped', n, e)\nelse:\n    print('wrote', n)"
    )
    for target in (sb.workdir, "/tmp", "/dev/shm"):
        res = await sb.exec(["python3", "-I", "-S", "-c", writer, target], timeout=20)
        assert "stopped" in res.stdout, (target, res)
        written_mb = int(res.stdout.split()[1])
        assert written_mb <= 34, (target, res.stdout)
    for target in ("/", "/usr", "/etc"):
        res = await sb.exec(["python3", "-I", "-S", "-c", writer, target], timeout=20)
        assert "stopped 0" in res.stdout, (target, res)
    await fresh_ok(backend)


@BWRAP_ONLY
async def test_network_blocked(backend, make_sandbox, require, fresh_ok):
    sb = make_sandbox(backend, timeout=10)
    await sb.start()
    require(sb, "network")
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(1)
    port = host.getsockname()[1]
    try:
        probe = (
            "import socket, sys\nfor addr in [('1.1.1.1', 53), ('127.0.0.1', int(sys.argv[1]))]:\n"
            "    s = socket.socket(); s.settimeout(2)\n"
            "    try:\n        s.connect(addr); print('CONNECTED', addr)\n"
            "    except OSError as e:\n        print('blocked', addr, e)\n"
            "try:\n    socket.getaddrinfo('example.com', 80); print('RESOLVED')\n"
            "except OSError as e:\n    print('no dns', e)"
        )
        res = await sb.exec(["python3", "-I", "-S", "-c", probe, str(port)], timeout=10)
    finally:
        host.close()
    assert "CONNECTED" not in res.stdout and "RESOLVED" not in res.stdout, res
    assert res.stdout.count("blocked") == 2, res
    await fresh_ok(backend)


@BWRAP_ONLY
async def test_read_host_home_and_root(backend, make_sandbox, require, fresh_ok):
    sb = make_sandbox(backend, timeout=10)
    await sb.start()
    require(sb, "filesystem")
    secret = Path.home() / f".rl360-sandbox-secret-{uuid.uuid4().hex[:8]}"
    secret.write_text("TOPSECRET")
    try:
        res = await sb.exec(
            f"cat {secret}; cat /etc/shadow; ls -a /root; ls /home; cat /root/.bashrc", timeout=10
        )
    finally:
        secret.unlink()
    assert "TOPSECRET" not in res.stdout, res
    assert "root:" not in res.stdout
    assert res.exit_code != 0
    await fresh_ok(backend)


@BWRAP_ONLY
async def test_write_outside_workdir(backend, make_sandbox, require, tmp_path, fresh_ok):
    sb = make_sandbox(backend, timeout=10)
    await sb.start()
    require(sb, "filesystem")
    host_target = tmp_path / "victim.txt"
    targets = [
        "/usr/pwned",
        "/etc/pwned",
        "/pwned",
        "/root/pwned",
        str(host_target),
        f"{os.getcwd()}/pwned",
    ]
    script = "; ".join(f"echo x > {t} && echo WROTE {t}" for t in targets)
    res = await sb.exec(script, timeout=10)
    assert "WROTE" not in res.stdout, res
    assert not _exists(host_target)
    assert not _exists(os.path.join(os.getcwd(), "pwned"))
    ok = await sb.exec("echo fine > inside.txt && cat inside.txt", timeout=10)
    assert ok.stdout.strip() == "fine"
    await fresh_ok(backend)


async def test_background_process_gone_after_close(backend, make_sandbox, fresh_ok, wait_until):
    sb = make_sandbox(backend, timeout=10)
    await sb.start()
    daemon = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(300)\n    os._exit(0)\n"
    )
    res = await sb.exec(
        f'setsid sleep 300 & nohup sleep 301 >/dev/null 2>&1 & python3 -c "{daemon}"; echo started',
        timeout=10,
    )
    assert "started" in res.stdout
    pids: list[int] = []

    async def three_sleepers() -> bool:
        pids[:] = await sb.host_pids()
        return len([p for p in pids if _alive(p) and "sleep" in _cmdline(p)]) >= 3

    assert await wait_until(three_sleepers), (pids, res)
    await sb.close()
    assert await wait_until(lambda: not [p for p in pids if _alive(p)]), "processes survived close"
    assert await sb.host_pids() == []
    await fresh_ok(backend)


@BWRAP_ONLY
async def test_env_clearing_daemon_gone_after_close(
    backend, make_sandbox, require, fresh_ok, wait_until
):
    """A daemon that drops its environment: only a pid namespace / cgroup catches it."""
    sb = make_sandbox(backend, timeout=10)
    await sb.start()
    res = await sb.exec("env -i setsid sleep 303 >/dev/null 2>&1 & echo started", timeout=10)
    assert "started" in res.stdout
    pids: list[int] = []

    async def daemon_seen() -> bool:
        pids[:] = await sb.host_pids()
        return any("sleep 303" in _cmdline(p) for p in pids)

    assert await wait_until(daemon_seen), pids
    await sb.close()
    assert await wait_until(lambda: not [p for p in pids if _alive(p)])
    await fresh_ok(backend)


@BWRAP_ONLY
async def test_killing_the_exec_server(backend, make_sandbox, require, fresh_ok):
    """Killing the sandbox's own helper would turn a failing episode into an unscored infra
    error; inside bwrap it is the namespace init and ignores signals from the sandbox."""
    sb = make_sandbox(backend, timeout=10)
    await sb.start()
    require(sb, "helper")
    res = await sb.exec("kill -9 $PPID; kill -9 1; kill -9 -1; echo after", timeout=10)
    assert res.exit_code in (0, -9, 137), res
    again = await sb.exec("echo still serving", timeout=10)
    assert again.ok and again.stdout == "still serving\n"
    await fresh_ok(backend)


async def test_process_backend_reports_what_it_lacks(make_sandbox):
    """The process backend isolates nothing but CPU time and per-process memory: every other
    protection is reported missing (so each episode counts it, and rl360 preflight names it),
    and its cleanup finds processes by an environment marker only (an `env -i` daemon
    escapes it: security.md)."""
    sb = make_sandbox("process", timeout=10)
    await sb.start()
    assert sorted(sb.protections.missing()) == sorted(PROCESS_GAPS)
    assert "environment" in sb.protections.cleanup
    assert sb.protections.cpu and sb.protections.memory
