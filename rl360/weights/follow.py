"""The replica side of weight sync: follow the publisher and apply every newer version.

Each engine replica runs `follow_weights` as a named background task (rl360.serve.engines.
replica). It registers with the WeightPublisher (rl360.weights.publisher) how its engine takes
versions (the receiver protocol, rl360.weights.receiver), long-polls it, turns each announced
version into the `WeightUpdate` the engine takes (rl360.weights.payloads) and reports what it
applied, where the time went and, every poll, the engine's health.

What an announcement holds, by transport:
- a packed chain (object store or weight slot, rl360.weights.packing): fetched zero-copy; an
  engine that loads packed versions gets a FullUpdate / SlotUpdate / DeltaUpdate, any other a
  TensorUpdate of the full version's views;
- a planned collective version (buckets over NCCL or gloo, or CUDA IPC): a CollectiveUpdate or
  IpcUpdate for an engine with its own weight group, else received here into a TensorUpdate
  (rl360.weights.collective_replica);
- a gloo collective version: received here over the gloo group into a TensorUpdate (an
  AdapterUpdate when the payload describes an adapter);
- a sharded collective version ({"kind": "sharded"}: every trainer rank's buckets over groups
  of an epoch of membership): received from every rank at once into a TensorUpdate, or waited
  out by a replica outside the epoch (rl360.weights.shard_replica);
- an adapter version in the object store ({"kind": "adapter"}): fetched into an AdapterUpdate
  (rl360.weights.adapters), its checksum checked;
- a plain [ref] (a state dict the driver put): fetched into a TensorUpdate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from rl360.weights.payloads import (
    AdapterUpdate,
    PackedUpdate,
    SlotUpdate,
    TensorUpdate,
    WeightUpdate,
)
from rl360.weights.receiver import Intake, WeightReceiver
from rl360.weights.shard_replica import ShardLinks, is_sharded, take_sharded

if TYPE_CHECKING:
    from rl360.weights.slots import SlotReader

log = logging.getLogger("rl360.weights")


class SlotUnusable(Exception):
    """A weight slot this process cannot map (on another node, /proc closed), or a bad stamp."""


class _Links:
    """What a replica keeps between versions: the collective groups it joined, the weight
    slots it mapped."""

    def __init__(self, slots: SlotReader) -> None:
        self.slots = slots
        self.receiver: Any = None  # a planned group's receiver (NCCL, or gloo by buckets)
        self.gloo: Any = None  # the CPU collective's gloo group
        self.shards = ShardLinks()  # the sharded collective's groups, plan and epoch


async def follow_weights(publisher: Any, backend: WeightReceiver, replica: str,
                         poll_s: float = 2.0, caught_up: asyncio.Event | None = None) -> None:
    """Apply every newer published version (runs as a named task), and report the backend's
    health (busy time, tokens) every `poll_s` for the run's metrics. `caught_up` is set once
    the replica serves the newest version the publisher had when it first asked (a restarted
    replica must not serve base weights). With a hint (the weight slot the next version goes
    to) the replica also sleeps on that slot and loads the version as soon as the sender has
    written it, before the publisher's announcement arrives."""
    # the replica's side needs torch; imported here so that importing this module (the
    # replica's, the session shards') does not spend seconds of start-up importing it
    from rl360.weights.adapters import AdapterChecksumError
    from rl360.weights.collective_replica import replica_info
    from rl360.weights.slots import SlotReader, SlotWatch

    intake = backend.weight_intake()
    info = await asyncio.to_thread(replica_info, intake)
    rank = await publisher.register.remote(replica, info)
    links = _Links(SlotReader())
    have = backend.version
    first = True
    serving_slot = ""  # the weight slot this replica's parameters view ("" none)
    poll: asyncio.Future[Any] | None = None
    watch: SlotWatch | None = None  # sleeping on the hinted slot
    try:
        while True:
            if poll is None:
                await publisher.report_stats.remote(replica, backend.health(), have,
                                                    serving_slot, info)
                poll = asyncio.ensure_future(publisher.wait_newer.remote(
                    max(have, links.shards.skip), 0.0 if first else poll_s, replica,
                    links.shards.epoch))
                first = False
            waits: list[asyncio.Future[Any]] = [poll]
            if watch is not None and watch.after >= have:
                waits.append(watch.task)
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if poll.done():
                version, payload = poll.result()
                poll = None
                if watch is not None and (watch.after, watch.slot) != _hint_of(version, payload):
                    watch.stop()
                    watch = None
                if watch is None and version >= have and _hint_of(version, payload)[1]:
                    watch = SlotWatch.start(links.slots, version, payload["next"],
                                            payload["layout"], name=f"rl360-slot-watch-{replica}")
                watched = False
            else:  # the hinted slot holds a newer version: no need to wait for the publisher
                assert watch is not None
                version, payload = watch.payload()
                watch.stop()
                watch = None
                watched = True
            if is_sharded(payload):  # every trainer rank's buckets, over an epoch's groups
                have, serving = await take_sharded(publisher, backend, replica, version,
                                                   payload, have, links.shards)
                if serving and caught_up is not None:
                    caught_up.set()
                continue
            if version <= have or not payload:
                if caught_up is not None:
                    caught_up.set()
                continue
            t0 = time.perf_counter()
            try:
                update, fetched = await receive(payload, have, intake, rank, links)
            except SlotUnusable as e:  # versions go through the object store from now on
                await publisher.slot_unusable.remote(replica, str(e))
                if watch is not None:
                    watch.stop()
                    watch = None
                continue
            except AdapterChecksumError as e:  # keep serving what it has; fetch it again
                log.error("replica %s: %s", replica, e)
                await asyncio.sleep(poll_s)
                continue
            t1 = time.perf_counter()
            if await backend.update_weights(version, update):
                have = version
                if isinstance(payload, dict) and payload.get("checksum"):
                    await _report_checksums(publisher, backend, replica, version, payload, update)
                detail = fetched.detail() if fetched is not None else {}
                serving_slot = fetched.slot if isinstance(fetched, SlotUpdate) and \
                    fetched.borrowed else ""
                detail |= {"slot": serving_slot, "watched": watched}
                # where this replica's share of the sync went: fetching / receiving the
                # version, then queueing for and running the engine's load (apply_s,
                # apply_cpu_s inside)
                detail |= {"fetch_s": t1 - t0, "update_s": time.perf_counter() - t1}
                await publisher.report_applied.remote(replica, version, detail)
            else:
                have = max(have, backend.version)
            if caught_up is not None:
                caught_up.set()
            del update, fetched
    finally:
        if watch is not None:
            watch.stop()


async def receive(payload: Any, have: int, intake: Intake, rank: int, links: _Links
                  ) -> tuple[WeightUpdate, PackedUpdate | AdapterUpdate | None]:
    """(the update the engine takes for an announced version (see the module's docstring),
    what was fetched of a packed chain or an adapter: its detail goes into the applied
    report)."""
    from rl360.weights.adapters import received_adapter, unpack_adapter
    from rl360.weights.collective_replica import gloo_state, gpu_state
    from rl360.weights.packing import fetch_update, packed_tensors

    if isinstance(payload, dict) and payload.get("kind") == "adapter":  # object store
        adapter = unpack_adapter(await payload["ref"])
        return adapter, adapter

    if isinstance(payload, dict) and payload.get("kind") == "packed":  # object store, slots
        try:
            packed = await fetch_update(payload, have, intake.packed, links.slots)
        except OSError as e:
            raise SlotUnusable(str(e)) from e
        return (packed if intake.packed else TensorUpdate(packed_tensors(packed))), packed
    if isinstance(payload, dict) and payload.get("planned"):  # buckets / NCCL / IPC
        update, links.receiver = await gpu_state(payload, intake, rank, links.receiver)
        return update, None
    if isinstance(payload, dict):  # collective: join the group once, then receive
        update, links.gloo = await gloo_state(payload, rank, links.gloo)
        if payload.get("adapter"):
            adapter = received_adapter(update.tensors, payload["adapter"])
            return adapter, adapter
        return update, None
    return TensorUpdate(await payload[0]), None  # a state dict in the object store


async def _report_checksums(publisher: Any, backend: WeightReceiver, replica: str, version: int,
                            payload: dict[str, Any], update: WeightUpdate) -> None:
    """The checksum option: what the engine now serves of the tensors the version carried."""
    from rl360.weights.collective_replica import sent_names

    sums = await backend.weight_checksums(sent_names(payload), update)
    await publisher.report_checksums.remote(replica, version, msgspec.to_builtins(sums))


def _hint_of(version: int, payload: Any) -> tuple[int, str]:
    """(the version a hint follows, the slot it names) of a publisher's answer ("": none)."""
    hint = payload.get("next") if isinstance(payload, dict) else None
    return (version, str(hint["slot"])) if isinstance(hint, dict) else (version, "")
