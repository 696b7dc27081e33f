"""Versioned weights for engine replicas: a publisher actor and the replica-side subscriber.

Serve does not let a caller address every replica of a deployment, so replicas pull: the
trainer side puts a state dict in the object store once and publishes (version, ref); every
engine replica long-polls the publisher in a named background task and applies newer versions
between batches. A replica that starts late fetches the newest version at once. Versions only
move forward; an older or equal version is ignored by the backend, which logs it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

log = logging.getLogger("rl360.weights")


class WeightPublisher:
    """Ray actor: holds the newest (version, [state ref]) and wakes waiting replicas."""

    def __init__(self) -> None:
        self.version = 0
        self.refs: list[Any] = []  # [ObjectRef], wrapped so Ray does not resolve it
        self.published_at = 0.0
        self._changed = asyncio.Event()
        self._applied_changed = asyncio.Event()
        self.applied: dict[str, tuple[int, float]] = {}
        self.engine_stats: dict[str, dict[str, Any]] = {}

    async def publish(self, version: int, wrapped_ref: list[Any]) -> bool:
        if version <= self.version:
            log.warning("not publishing version %d: %d is already out", version, self.version)
            return False
        self.version, self.refs, self.published_at = version, wrapped_ref, time.time()
        self._changed.set()
        self._changed = asyncio.Event()
        return True

    async def wait_newer(self, have: int, timeout_s: float) -> tuple[int, list[Any]]:
        if self.version <= have:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except TimeoutError:
                pass
        return self.version, self.refs

    async def report_applied(self, replica: str, version: int) -> None:
        self.applied[replica] = (version, time.time() - self.published_at)
        self._applied_changed.set()
        self._applied_changed = asyncio.Event()

    async def wait_applied(self, version: int, replicas: int, timeout_s: float) -> int:
        """Wait up to `timeout_s` until `replicas` engine replicas serve >= `version`; returns
        the lowest version those replicas serve (0 before any update was applied)."""
        deadline = time.monotonic() + timeout_s
        while True:
            served = sorted((v for v, _ in self.applied.values()), reverse=True)[:replicas]
            low = min(served) if len(served) >= replicas else 0
            remaining = deadline - time.monotonic()
            if low >= version or remaining <= 0:
                return low
            try:
                await asyncio.wait_for(self._applied_changed.wait(), remaining)
            except TimeoutError:
                pass

    async def report_stats(self, replica: str, stats: dict[str, Any]) -> None:
        self.engine_stats[replica] = stats

    async def status(self) -> dict[str, Any]:
        return {"version": self.version, "applied": dict(self.applied),
                "engines": dict(self.engine_stats)}


async def follow_weights(publisher: Any, backend: Any, replica: str, poll_s: float = 2.0) -> None:
    """Replica side: apply every newer published version (runs as a named task), and report
    the backend's health (busy time, tokens) every `poll_s` for the run's metrics."""
    have = backend.version
    while True:
        await publisher.report_stats.remote(replica, backend.health())
        version, wrapped = await publisher.wait_newer.remote(have, poll_s)
        if version <= have or not wrapped:
            continue
        state = await wrapped[0]
        if await backend.update_weights(version, state):
            have = version
            await publisher.report_applied.remote(replica, version)
        else:
            have = max(have, backend.version)
        del state
