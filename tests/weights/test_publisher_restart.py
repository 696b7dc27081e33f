"""A restarted WeightPublisher comes back empty: without Ray, the replicas' polls tell it
what each serves again, a delta it cannot extend is refused and the same version sent full is
taken, and a replica that starts behind waits until it caught up before it serves."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from rl360.weights.follow import follow_weights
from rl360.weights.packing import WeightPacker
from rl360.weights.payloads import TensorUpdate, WeightUpdate
from rl360.weights.publisher import WeightPublisher
from rl360.weights.receiver import Intake, WeightChecksums


def _meta(packet: Any) -> dict[str, Any]:
    return {**packet.meta(), "ref": ["unused"]}


async def test_a_restarted_publisher_learns_the_served_versions_from_the_polls() -> None:
    pub = WeightPublisher()  # what Ray's restart gives: nothing applied, version 0
    assert await pub.wait_applied(3, 2, 0.01) == 0
    await pub.report_stats("r1", {}, 3)
    await pub.report_stats("r2", {}, 4)
    assert await pub.wait_applied(3, 2, 0.01) == 3  # the controller's gate opens again
    await pub.report_stats("r1", {}, 2)  # never moves back
    assert pub.applied["r1"][0] == 3


async def test_a_delta_the_restarted_publisher_cannot_extend_goes_full() -> None:
    state = {"w": torch.randn(64, 64), "b": torch.zeros(64)}
    packer = WeightPacker(delta=True, max_delta_fraction=1.0)
    old = WeightPublisher()
    assert await old.publish_packed(1, _meta(packer.pack(1, state)))
    state["w"][0, 0] += 1.0
    delta = packer.pack(2, state)
    assert delta.kind == "delta"
    fresh = WeightPublisher()  # restarted: the chain the delta extends is gone
    assert not await fresh.publish_packed(2, _meta(delta))
    full = packer.repack_full(2, state)
    assert full.kind == "full" and await fresh.publish_packed(2, _meta(full))
    state["w"][1, 1] += 1.0  # and the chain goes on from the full version
    assert await fresh.publish_packed(3, _meta(packer.pack(3, state)))


class _Backend:
    """A weight receiver that keeps what it was handed."""

    def __init__(self) -> None:
        self.version = 0
        self.updates: list[WeightUpdate] = []

    def health(self) -> dict[str, Any]:
        return {}

    def weight_intake(self) -> Intake:
        return Intake()

    async def update_weights(self, version: int, update: WeightUpdate) -> bool:
        self.version = version
        self.updates.append(update)
        return True

    async def weight_checksums(self, names: list[str], update: WeightUpdate) -> WeightChecksums:
        return WeightChecksums(None, {})


class _Handle:
    """Calls a local publisher the way an actor handle does (`.remote()` -> awaitable)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.target, name)

        class _M:
            @staticmethod
            def remote(*a: Any, **k: Any) -> Any:
                return asyncio.ensure_future(method(*a, **k))

        return _M


async def test_a_replica_is_caught_up_only_once_it_holds_the_published_version() -> None:
    pub = WeightPublisher()
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    await pub.publish(5, [fut])  # version 5 is out; its weights arrive later
    backend, ready = _Backend(), asyncio.Event()
    task = asyncio.create_task(follow_weights(_Handle(pub), backend, "r1", 0.05, ready))
    await asyncio.sleep(0.2)
    assert not ready.is_set() and backend.version == 0  # it would serve base weights: it waits
    fut.set_result({"w": torch.zeros(1)})
    await asyncio.wait_for(ready.wait(), 5)
    assert backend.version == 5
    [update] = backend.updates  # the state dict the driver put, as tensors
    assert isinstance(update, TensorUpdate) and list(update.tensors) == ["w"]
    task.cancel()
