"""A version gate for engines that batch on their own (SGLang, vLLM): requests hold a read
side for their whole generation, a weight update holds the write side.

While an update waits, new requests wait behind it (writer preference, so a steady stream of
requests cannot starve the trainer); the update starts once the requests already running have
finished. So a sequence is generated under one version, which the gate names, and an engine
never serves a half-applied update. `pause()` closes the gate to new requests without an update.

`swapping()` is the other writer, for engines that pause their own scheduler (SGLang's
retract / in_place / abort modes): it closes the gate to new requests but does NOT wait for
the running ones, which the engine itself holds (or ends) while weights change. Such a
request can then span two versions: the backend compares the version it started under with
`version` when it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager


class VersionGate:
    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._readers = 0
        self._writers_waiting = 0
        self._writing = False
        self._paused = False
        self._cond = asyncio.Condition()

    @property
    def in_flight(self) -> int:
        return self._readers

    @property
    def paused(self) -> bool:
        return self._paused

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[int]:
        """Hold for one generation; yields the version it runs under."""
        async with self._cond:
            await self._cond.wait_for(
                lambda: not self._writing and not self._writers_waiting and not self._paused)
            self._readers += 1
            version = self.version
        try:
            yield version
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    def writing(self) -> AbstractAsyncContextManager[None]:
        """Hold while weights change: waits for running generations, blocks new ones."""
        return self._exclusive(drain=True)

    def swapping(self) -> AbstractAsyncContextManager[None]:
        """Hold while weights change under the engine's own pause: blocks new generations,
        lets running ones stay in flight (the engine pauses them)."""
        return self._exclusive(drain=False)

    @asynccontextmanager
    async def _exclusive(self, drain: bool) -> AsyncIterator[None]:
        """One writer at a time, new readers blocked; with `drain`, also no running reader."""
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(
                    lambda: not self._writing and (not drain or self._readers == 0))
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            async with self._cond:
                self._writing = False
                self._cond.notify_all()

    @property
    def updating(self) -> bool:
        """A weight update is running or waiting (drain or swap)."""
        return self._writing or self._writers_waiting > 0

    async def set_paused(self, paused: bool) -> None:
        async with self._cond:
            self._paused = paused
            self._cond.notify_all()
