"""Warm grading sandboxes: exclusive per op, swept after each, retired on an anomaly (a process
that outlived its grading) or after max_uses."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rl360.envs.agent import ScriptedClient, run_episode
from rl360.envs.code import CodeEnv
from rl360.envs.sandbox import SandboxLimits, build_sandbox
from rl360.envs.sandbox.base import ExecResult, Protections, Sandbox, SandboxStartError
from rl360.envs.sandbox.pool import GradingPool, PooledSandbox
from rl360.types import Message, Task

pytestmark = pytest.mark.timeout(120)


def _view(pool: GradingPool, backend: str) -> PooledSandbox:
    return PooledSandbox(pool, "k", lambda: build_sandbox(backend, SandboxLimits()))


async def test_files_are_swept_and_daemons_retire_the_sandbox(bwrap_backend):
    pool = GradingPool(size=1, max_uses=10)
    try:
        sb = _view(pool, bwrap_backend)
        await sb.exec("echo secret > left.txt; echo t > /tmp/t.txt", timeout=20)
        first = pool.slots["k"].idle[0].sandbox
        res = await sb.exec("ls -A; ls -A /tmp", timeout=20)
        assert "left.txt" not in res.stdout and "t.txt" not in res.stdout
        assert pool.slots["k"].idle[0].sandbox is first  # clean: kept warm
        await sb.exec("setsid sh -c 'sleep 1000' >/dev/null 2>&1 < /dev/null &", timeout=20)
        assert pool.counts["anomalies"] == 1 and pool.counts["stray_procs"] >= 1
        assert not pool.slots["k"].idle  # retired, not returned
        res = await sb.exec("ps -e -o comm= | grep -c sleep || true", timeout=20)
        assert res.stdout.strip() == "0"
        assert pool.slots["k"].idle[0].sandbox is not first
        await sb.close()
    finally:
        await pool.close()


async def test_recycled_after_max_uses_and_exclusive(bwrap_backend):
    pool = GradingPool(size=2, max_uses=2)
    try:
        sb = _view(pool, bwrap_backend)
        # four concurrent gradings on two sandboxes: each sees only its own file
        script = "echo $1 > mine; sleep 0.2; cat mine; ls | wc -l"
        outs = await asyncio.gather(
            *(sb.exec(["sh", "-c", script, "x", str(i)], timeout=20) for i in range(4))
        )
        for i, res in enumerate(outs):
            assert res.stdout.split() == [str(i), "1"], res
        assert pool.counts["gradings"] == 4 and pool.counts["recycled"] == 2
        await sb.close()
    finally:
        await pool.close()


async def test_episode_on_a_pooled_sandbox(bwrap_backend):
    """What an env actor does with a grading-only env: the episode sees the warm sandbox's
    protections (none reported missing) and is graded there."""
    pool = GradingPool(size=1, max_uses=10)
    try:
        sb = _view(pool, bwrap_backend)
        task = Task(id="t", prompt="p", data={"tests": ["assert f() == 3"]})
        client = ScriptedClient([Message(role="assistant", content="def f():\n    return 3")])
        res = await run_episode(CodeEnv(), task, sb, client)
        assert res.status == "ok" and res.reward.value == 1.0, res.reason
        assert not [k for k in res.counters if k.startswith("sandbox_missing_")], res.counters
        await sb.close()
    finally:
        await pool.close()


async def test_gradings_leave_no_process_behind(bwrap_backend):
    """The grader's zygote and its children are gone when a grading ends, so the sweep finds
    nothing and one warm sandbox serves every grading (a stray would retire it each time)."""
    pool = GradingPool(size=1, max_uses=10)
    try:
        sb = _view(pool, bwrap_backend)
        task = Task(id="t", prompt="p", data={"tests": ["assert f() == 3", "assert f() != 4",
                                                       "assert f() > 0"]})
        for answer in ("def f():\n    return 3", "def f():\n    return 4"):
            res = await run_episode(CodeEnv(), task, sb, ScriptedClient(
                [Message(role="assistant", content=answer)]))
            assert res.status == "ok", res.reason
        assert abs(res.reward.value - 1 / 3) < 1e-9  # only `f() > 0` holds for 4
        assert pool.counts["gradings"] == 2 and pool.counts["stray_procs"] == 0
        assert pool.counts["recycled"] == 0 and len(pool.slots["k"].idle) == 1
        await sb.close()
    finally:
        await pool.close()


class _SlowStart(Sandbox):
    """Counts its starts; each takes a moment (a bwrap start, without bwrap)."""

    backend = "fake"
    starts = 0
    fail_next = 0

    async def start(self) -> None:
        if self._started:
            return
        type(self).starts += 1
        await asyncio.sleep(0.05)
        if type(self).fail_next:
            type(self).fail_next -= 1
            raise SandboxStartError("no room")
        self.protections = Protections(network="netns")
        self._started = True

    async def exec(self, cmd: Any, timeout: float | None = None,  # noqa: ASYNC109
                   cwd: str | None = None, env: Any = None, stdin: Any = None) -> ExecResult:
        await self.start()
        return ExecResult("", "", 0)

    async def write_file(self, path: str, data: str | bytes, mode: int | None = None) -> None:
        await self.start()

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        return b""

    async def close(self) -> None:
        self._closed = True


async def test_episodes_arriving_together_wait_for_one_sandbox_start():
    """The episodes of a first batch all call start() before their first turn: one sandbox
    starts for them (not `size` in turns, each blocking the episodes queued behind it), they
    all get its protections, and later starts answer without a lease."""
    _SlowStart.starts, _SlowStart.fail_next = 0, 0
    pool = GradingPool(size=8, max_uses=10)
    views = [PooledSandbox(pool, "k", _SlowStart) for _ in range(64)]
    await asyncio.gather(*(v.start() for v in views))
    assert _SlowStart.starts == 1
    assert {v.protections.network for v in views} == {"netns"}
    late = PooledSandbox(pool, "k", _SlowStart)
    await asyncio.wait_for(late.start(), 0.01)  # no start, no lease
    assert late.protections.network == "netns" and _SlowStart.starts == 1
    await pool.close()


async def test_a_failed_shared_start_fails_only_its_own_episode():
    """The episode whose start failed sees the error; the ones that waited on it start one of
    their own instead of failing with it."""
    _SlowStart.starts, _SlowStart.fail_next = 0, 1
    pool = GradingPool(size=8, max_uses=10)
    views = [PooledSandbox(pool, "k", _SlowStart) for _ in range(4)]
    res = await asyncio.gather(*(v.start() for v in views), return_exceptions=True)
    failed = [r for r in res if isinstance(r, SandboxStartError)]
    assert len(failed) == 1 and res[0] is failed[0]
    assert all(v.protections.network == "netns" for v in views[1:])
    await pool.close()
