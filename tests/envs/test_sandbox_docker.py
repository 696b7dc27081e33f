"""The docker backend and its own protections (an egress-only network for public tasks, no
capabilities, limits, a task's Dockerfile built once per content), where a Docker engine runs;
skipped with "no Docker engine" elsewhere (rl360 preflight lists them as missing there)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from rl360.envs.sandbox import SandboxLimits, build_sandbox, unavailable_reason
from rl360.envs.sandbox.docker import task_image_tag

WHY = unavailable_reason("docker")
pytestmark = [
    pytest.mark.skipif(WHY is not None, reason=str(WHY)),  # "no Docker engine: ..."
    pytest.mark.timeout(900),
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



async def docker(*args: str, check: bool = True) -> str:
    """stdout of `docker *args` (run on a thread: the test's loop stays free)."""
    def run() -> str:
        return subprocess.run(["docker", *args], capture_output=True, text=True,
                              check=check).stdout
    return await asyncio.to_thread(run)


async def test_public_network_is_an_egress_only_bridge_never_the_host():
    async with build_sandbox("docker", SandboxLimits(timeout=30, network=True)) as sb:
        assert "rl360-egress" in sb.protections.network
        out = await docker("inspect", "--format",
                           "{{json .NetworkSettings.Networks}} {{.HostConfig.NetworkMode}}",
                           sb.container)
        assert "rl360-egress" in out and "host" not in out.split()[-1]
        opts = await docker("network", "inspect", "--format", "{{json .Options}}",
                            "rl360-egress")
        assert json.loads(opts)["com.docker.network.bridge.enable_icc"] == "false"


async def test_no_capabilities_and_the_limits_hold():
    lim = SandboxLimits(timeout=30, memory_mb=256, max_procs=32)
    async with build_sandbox("docker", lim) as sb:
        caps = await sb.exec("grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status")
        assert caps.ok and all(line.split()[1] == "0000000000000000"
                               for line in caps.stdout.splitlines()), caps.stdout
        assert (await sb.exec("touch /usr/x")).exit_code != 0  # read-only root
        out = await docker("inspect", "--format",
                           "{{.HostConfig.Memory}} {{.HostConfig.PidsLimit}} "
                           "{{.HostConfig.ReadonlyRootfs}} {{json .HostConfig.SecurityOpt}}",
                           sb.container)
        mem, pids, ro, sec = out.split(" ", 3)
        assert int(mem) == 256 * 1024 * 1024 and int(pids) == 32 and ro == "true"
        assert "no-new-privileges" in sec
        assert not sb.protections.missing()


async def test_a_task_dockerfile_is_built_once_per_content(tmp_path: Path):
    ctx = tmp_path / "environment"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM python:3.11-slim\nRUN mkdir -p /app && "
                                    "echo built > /app/marker\nWORKDIR /app\n")
    tag = task_image_tag(ctx)
    await docker("rmi", "-f", tag, check=False)
    sb = build_sandbox("docker", SandboxLimits(timeout=60), "/app", build_context=str(ctx))
    async with sb:
        assert sb.image == tag
        assert (await sb.exec("cat /app/marker")).stdout.strip() == "built"
        assert (await sb.exec("echo x > /app/new && cat /app/new")).stdout.strip() == "x"
        assert sb.protections.missing() == ["disk"]  # a volume work dir has no size cap
    built = await docker("image", "inspect", "--format", "{{.Id}}", tag)
    async with build_sandbox("docker", SandboxLimits(timeout=60), "/app",
                             build_context=str(ctx)) as again:
        assert again.image == tag
    assert await docker("image", "inspect", "--format", "{{.Id}}", tag) == built
    (ctx / "Dockerfile").write_text((ctx / "Dockerfile").read_text() + "ENV CHANGED=1\n")
    assert task_image_tag(ctx) != tag  # new content, new image
