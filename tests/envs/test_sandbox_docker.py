"""The docker backend, where a Docker engine runs (skipped with the reason elsewhere)."""

from __future__ import annotations

import pytest

from rl360.envs.sandbox import SandboxLimits, build_sandbox, unavailable_reason

WHY = unavailable_reason("docker")
pytestmark = [
    pytest.mark.skipif(WHY is not None, reason=f"docker sandbox unavailable: {WHY}"),
    pytest.mark.timeout(300),
]


async def test_docker_exec_files_and_caps():
    async with build_sandbox("docker", SandboxLimits(timeout=20, memory_mb=256)) as sb:
        res = await sb.exec("echo hi; id -u")
        assert res.ok and res.stdout.split() == ["hi", "65534"]
        await sb.write_file("a/b.txt", "data")
        assert await sb.read_file("a/b.txt") == b"data"
        net = await sb.exec(
            ["python3", "-c", "import socket; socket.create_connection(('1.1.1.1', 53), 2)"]
        )
        assert net.exit_code != 0
        slow = await sb.exec("sleep 30", timeout=1)
        assert slow.timed_out
        assert (await sb.exec("echo again")).stdout.strip() == "again"
