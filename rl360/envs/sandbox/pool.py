"""Warm grading sandboxes, reused but never shared: one grading (one exec) at a time per
sandbox, swept after each, recycled after `max_uses` gradings or at the first anomaly.

A grading-only episode (CodeEnv without tools) needs no private sandbox, and starting one per
grading costs a bwrap start. Reuse is safe only when nothing of one grading can reach the next:
so a lease is exclusive, and when it ends every process left in the sandbox is killed and its
writable dirs are emptied (`Sandbox.sweep`). Stray processes found by that sweep (a daemon the
solution left), a failed sweep, or an anomaly the caller reports (an infra error) retire the
sandbox instead of returning it to the pool. `PooledSandbox` is the Sandbox an episode sees:
each of its ops takes a lease for just that op, so an episode waiting on the model holds none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rl360.envs.sandbox.base import ExecResult, Protections, Sandbox, SandboxError

log = logging.getLogger(__name__)


@dataclass
class Lease:
    sandbox: Sandbox
    uses: int = 0
    anomaly: str = ""  # set by the caller to retire the sandbox after this grading


@dataclass
class _Slot:
    idle: list[Lease] = field(default_factory=list)
    count: int = 0  # sandboxes alive for this key (idle + leased)
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)


class GradingPool:
    def __init__(self, size: int = 8, max_uses: int = 64, sweep_dirs: Sequence[str] = ()):
        if size < 1 or max_uses < 1:
            raise ValueError("GradingPool size and max_uses must be >= 1")
        self.size = size
        self.max_uses = max_uses
        self.sweep_dirs = list(sweep_dirs)
        self.slots: dict[str, _Slot] = {}
        self.counts = {"gradings": 0, "recycled": 0, "anomalies": 0, "stray_procs": 0}
        # per key: the protections of its first sandbox that started, and that start while it
        # runs (the episodes that ask meanwhile wait for it instead of each leasing one)
        self.known: dict[str, Protections] = {}
        self._first: dict[str, asyncio.Task[Protections]] = {}

    async def warm_start(self, key: str, make: Callable[[], Sandbox]) -> Protections:
        """A warm sandbox for `key` has started: its protections. The first call per key starts
        one (nothing runs in it); calls while it starts wait for that start, and later calls
        answer at once. An episode asks before its first turn, so a batch of episodes arriving
        together waits for one sandbox start, not for `size` of them in turns; the others start
        when gradings need them. A waiter whose shared start failed tries one of its own."""
        if (known := self.known.get(key)) is not None:
            return known
        first = self._first.get(key)
        if first is None:
            first = asyncio.get_running_loop().create_task(
                self._start_one(key, make), name=f"rl360-warm-sandbox-{len(self.known)}")
            self._first[key] = first
            first.add_done_callback(lambda t: self._first_done(key, t))
            return await asyncio.shield(first)  # a cancelled episode leaves the start running
        try:
            return await asyncio.shield(first)
        except asyncio.CancelledError:
            raise
        except Exception:
            return await self._start_one(key, make)

    def _first_done(self, key: str, task: asyncio.Task[Protections]) -> None:
        self._first.pop(key, None)
        if not task.cancelled() and task.exception() is not None:  # its waiters saw it too
            log.info("a warm sandbox did not start: %r", task.exception())

    async def _start_one(self, key: str, make: Callable[[], Sandbox]) -> Protections:
        async with self.lease(key, make, sweep=False) as lease:
            await lease.sandbox.start()
            self.known[key] = lease.sandbox.protections
            return lease.sandbox.protections

    @contextlib.asynccontextmanager
    async def lease(
        self, key: str, make: Callable[[], Sandbox], sweep: bool = True
    ) -> AsyncIterator[Lease]:
        """Exclusive use of a warm sandbox for `key` (made with `make` when none is idle and
        fewer than `size` exist; otherwise wait for one)."""
        slot = self.slots.setdefault(key, _Slot())
        async with slot.cond:
            while not slot.idle and slot.count >= self.size:
                await slot.cond.wait()
            if slot.idle:
                lease = slot.idle.pop()
            else:
                lease = Lease(make())
                slot.count += 1
        lease.anomaly = ""
        keep = False
        try:
            try:
                yield lease
            except SandboxError as e:
                lease.anomaly = f"{type(e).__name__}: {e}"
                raise
            keep = await self._sweep(lease) if sweep else True
        finally:
            if not keep:
                slot.count -= 1
                await self._retire(lease)
            async with slot.cond:
                if keep:
                    slot.idle.append(lease)
                slot.cond.notify()

    async def _sweep(self, lease: Lease) -> bool:
        """Sweep after a grading; True when the sandbox may serve another."""
        lease.uses += 1
        self.counts["gradings"] += 1
        if not lease.anomaly:
            try:
                dirs = [lease.sandbox.workdir, "/tmp", *self.sweep_dirs]
                if lease.sandbox.backend == "process":  # host dirs: its TMPDIR lives there
                    dirs = []
                stray = await lease.sandbox.sweep(dirs)
                if stray:
                    self.counts["stray_procs"] += stray
                    lease.anomaly = f"{stray} process(es) outlived the grading"
            except Exception as e:
                lease.anomaly = f"sweep failed: {type(e).__name__}: {e}"
        if lease.anomaly:
            self.counts["anomalies"] += 1
            log.info("retiring a grading sandbox: %s", lease.anomaly)
            return False
        return lease.uses < self.max_uses

    async def _retire(self, lease: Lease) -> None:
        self.counts["recycled"] += 1
        try:
            await lease.sandbox.close()
        except Exception as e:
            log.warning("closing a retired grading sandbox failed: %r", e)

    async def close(self) -> None:
        for slot in self.slots.values():
            for lease in slot.idle:
                await self._retire(lease)
            slot.idle.clear()
        self.slots.clear()


class PooledSandbox(Sandbox):
    """A Sandbox whose every op runs on a leased warm sandbox of `pool` (exclusive for the op,
    swept after it). Closing it closes nothing: the pool owns the sandboxes."""

    def __init__(self, pool: GradingPool, key: str, make: Callable[[], Sandbox]) -> None:
        self._pool, self._key, self._make = pool, key, make
        probe = make()  # unstarted: only its backend, limits and workdir are read
        super().__init__(probe.limits, probe.workdir)
        self.backend = probe.backend  # type: ignore[misc]
        self._spare: Sandbox | None = probe

    def _maker(self) -> Sandbox:
        spare, self._spare = self._spare, None
        return spare if spare is not None else self._make()

    async def _run(self, op: str, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        async with self._pool.lease(self._key, self._maker) as lease:
            return await getattr(lease.sandbox, op)(*args, **kwargs)

    async def start(self) -> None:
        """A warm sandbox of this view's key has started (the first call per key starts one,
        nothing runs in it; calls meanwhile wait for that start): its protections become this
        view's. Holds no lease: the episode's later ops lease whichever sandbox is idle."""
        self._check_open()
        if self._started:
            return
        self.protections = await self._pool.warm_start(self._key, self._maker)
        self._started = True

    async def exec(self, *args: Any, **kwargs: Any) -> ExecResult:  # type: ignore[override]
        return await self._run("exec", *args, **kwargs)

    async def write_file(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        await self._run("write_file", *args, **kwargs)

    async def read_file(self, *args: Any, **kwargs: Any) -> bytes:  # type: ignore[override]
        return await self._run("read_file", *args, **kwargs)

    async def close(self) -> None:
        self._closed = True
        spare, self._spare = self._spare, None
        if spare is not None:
            await spare.close()
