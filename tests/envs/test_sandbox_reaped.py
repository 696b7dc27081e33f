"""Closing a bwrap sandbox reaps every process of it. bwrap and the sandbox's init (the exec
server, pid 1 of its namespace) were killed together, so the init died with no parent to reap
it: it went to the host's init as a zombie (uid 65534, parent 1), which an init that reaps
lazily left for minutes and one that never reaps (a container's own process) keeps for good:
one per closed sandbox."""

from __future__ import annotations

import asyncio

import pytest

from rl360.envs.sandbox import SandboxLimits, build_sandbox, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason("bwrap") is not None,
                                reason=f"bwrap sandbox: {unavailable_reason('bwrap')}")


def alive_or_zombie(pid: int) -> str | None:
    """The process's state letter (Z for a zombie), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


async def test_a_closed_sandbox_leaves_no_process_not_even_a_zombie() -> None:
    pids: list[int] = []
    for _ in range(8):
        sb = build_sandbox("bwrap", SandboxLimits())
        await sb.start()
        await sb.exec("sleep 60 & sleep 60", timeout=0.5)  # a job still running at close
        pids += await sb.host_pids()
        await sb.close()
    await asyncio.sleep(0.2)
    left = {p: alive_or_zombie(p) for p in pids if alive_or_zombie(p) is not None}
    assert len(pids) >= 8 * 3 and left == {}, left
