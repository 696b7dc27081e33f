"""The engine replica's side of a sharded collective sync (called by
rl360.weights.follow.follow_weights for a {"kind": "sharded"} announcement).

An announcement names an epoch of membership: the replicas of its groups (replica -> rank),
every sending trainer rank's rendezvous, the plan (an object-store ref, fetched once per plan)
and the timeouts. A replica of the epoch joins its groups (once per epoch), receives every
rank's buckets at once (rl360.weights.shards.ShardReceiver) and hands the whole version to the
engine; a version it already serves (the same version sent again to a re-formed group) is
received and not applied. Either way it reports what it took with the epoch, which is what the
transport waits for. A replica that is not in the epoch (it just started) serves nothing yet:
the transport forms a new epoch with it at its next sync. A version that fails to arrive
(a timeout, a checksum, a sender gone) is logged in one line and reported with its reason
(the transport blames a replica that says nothing, not one that reports a sender's failure);
nothing of it is applied, and the replica waits for the next epoch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rl360.weights.payloads import TensorUpdate
from rl360.weights.receiver import WeightReceiver

log = logging.getLogger("rl360.weights")


class ShardLinks:
    """What a replica keeps between sharded versions."""

    def __init__(self) -> None:
        self.receiver: Any = None  # rl360.weights.shards.ShardReceiver, made at first use
        self.plan: Any = None
        self.plan_id = -1
        self.epoch = -1  # the newest epoch this replica has seen announced
        self.skip = 0  # a version announced in an epoch it could not take part in
        self.seen: tuple[int, int] = (0, -1)  # (version, epoch) of the last one handled


def is_sharded(payload: Any) -> bool:
    return isinstance(payload, dict) and payload.get("kind") == "sharded"


async def take_sharded(publisher: Any, backend: WeightReceiver, replica: str, version: int,
                       payload: dict[str, Any], have: int, links: ShardLinks
                       ) -> tuple[int, bool]:
    """Take part in the announced version's epoch; (the version the engine serves now, whether
    it serves the newest: False for a replica outside the epoch, which must not serve yet)."""
    from rl360.weights.shard_groups import ShardBroken, ShardReceiver

    epoch = int(payload["epoch"])
    if (version, epoch) == links.seen:
        return have, have >= version
    links.seen, links.epoch = (version, epoch), epoch
    members: dict[str, int] = payload["members"]
    if replica not in members:  # formed before this replica registered: wait for the next
        links.skip = version
        return have, have >= version
    if links.plan_id != payload["plan_id"]:
        links.plan, links.plan_id = await payload["plan"][0], payload["plan_id"]
    if links.receiver is None:
        links.receiver = ShardReceiver()
    recv = links.receiver
    senders = {int(r): (str(a[0]), int(a[1])) for r, a in payload["senders"].items()}
    t0 = time.perf_counter()
    try:
        if recv.epoch != epoch or not recv.groups:
            await asyncio.to_thread(recv.join, epoch, senders, int(members[replica]),
                                    int(payload["world"]), payload["backend"],
                                    float(payload["form_timeout_s"]))
        state = await asyncio.to_thread(recv.receive, links.plan, float(payload["timeout_s"]),
                                        bool(payload["checksum"]))
    except ShardBroken as exc:
        log.error("replica %s: weight version %d (epoch %d) not taken: %s", replica, version,
                  epoch, exc)
        links.skip = version
        await publisher.report_applied.remote(replica, have, {
            "epoch": epoch, "received": 0, "failed": str(exc)[:300] or "ShardBroken"})
        return have, have >= version
    t1 = time.perf_counter()
    applied = version > have and await backend.update_weights(version, TensorUpdate(state))
    now = version if applied else max(have, backend.version)
    links.skip = 0
    detail = {"epoch": epoch, "received": version, "applied": applied, "full": True,
              "deltas": 0, "bytes": links.plan.nbytes, "fetch_s": t1 - t0,
              "update_s": time.perf_counter() - t1}
    if payload.get("verify"):  # the checksum option: what the engine serves now
        import msgspec

        update = TensorUpdate(state)
        sums = await backend.weight_checksums(list(payload["names"]), update)
        await publisher.report_checksums.remote(replica, version, msgspec.to_builtins(sums))
    await publisher.report_applied.remote(replica, now, detail)
    return now, True
