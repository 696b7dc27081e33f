"""Weight transports: how a new policy version reaches every engine replica.

Both sit behind `WeightTransport.publish(version)` and both announce the version through the
WeightPublisher actor, which the replicas long-poll (rl360.weights.follow.follow_weights):

- "object_store": the trainer's rank 0 puts each version into the object store as one packed
  object (full, or a delta against the version before); each replica fetches it (zero-copy on
  the same node) and loads it into its parameters in place (rl360.weights.packing).
- "collective": a gloo group (NCCL on GPUs) of the sender (rank 0) and every engine replica;
  the weights are flattened into one buffer per dtype and broadcast, then unflattened on the
  replicas. No object store copy at all. With `sharded`, every trainer rank sends what it
  holds over groups that re-form with the live replicas (rl360.weights.shard_transport).

With `trainer.lora` the sender sends adapter versions (rl360.weights.adapters) through either
(the collective on gloo): the same calls, the adapter's tensors instead of the weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from rl360.ray_session import free_port
from rl360.recipe import CollectiveSync, ObjectStoreSync, WeightSync
from rl360.weights.plan import compare_checksums, plan_buckets
from rl360.weights.sender_calls import (
    Checksums,
    Describe,
    GpuUuid,
    Ipc,
    OpenGroup,
    Pack,
    ReleaseIpc,
    Send,
    Spec,
)
from rl360.weights.shard_transport import ShardedTransport


class WeightTransport(Protocol):
    def publish(self, version: int) -> bool: ...


class ObjectStoreTransport:
    """Rank 0 packs each version into ONE object-store object (rl360.weights.packing):
    full, or with `options.delta` the bits changed since the version before; replicas fetch
    zero-copy views and load them into their parameters in place.

    `sender`: an actor whose `weights(call)` runs a rl360.weights.sender.WeightSender call
    (the trainer's rank 0 worker, or a bench's stand-in); a TrainerGroup stands for its rank
    0. `dtype`: the engines' dtype (floating weights are cast to it before sending, and
    deltas are taken on it); `inplace`: the engines load packed updates in place (the torch
    backend), which deltas need; other backends get full versions as state dicts."""

    def __init__(self, serving: Any, sender: Any, options: ObjectStoreSync | None = None,
                 dtype: str | None = None, inplace: bool = True) -> None:
        self.serving = serving
        self.sender = sender.workers[0] if hasattr(sender, "workers") else sender
        o = options or ObjectStoreSync()
        self.packer = {"delta": o.delta and inplace, "max_delta_fraction": o.delta_max_fraction,
                       "bucket_mb": o.bucket_mb, "dtype": dtype, "zero_copy": o.zero_copy,
                       "slots": o.slots}
        self.last: dict[str, Any] = {}  # the last version's kind, bytes per replica, timings

    def publish(self, version: int) -> bool:
        import ray

        # the sender puts the version and announces it to the publisher itself
        meta = ray.get(self.sender.weights.remote(Pack(version, self.packer,
                                                       self.serving.publisher)))
        # kind, version, bytes per replica, and the sender's timings (pack_s, put_s, ...)
        self.last = {k: v for k, v in meta.items() if k not in ("layout", "published")}
        return bool(meta["published"])


class CollectiveTransport:
    """Broadcast from a sender holding the weights to every engine replica: over gloo (CPU), or
    on GPUs over NCCL / CUDA IPC (rl360.weights.nccl) as `options` (the recipe's
    CollectiveSync) say.

    `sender` is an actor whose `weights(call)` runs a rl360.weights.sender.WeightSender call
    (the trainer's rank 0 worker, or a bench's stand-in); the GPU paths also use its
    `weight_group_address()` (a free port on its node, rl360.actors.trainer_group.TrainerWorker)."""

    def __init__(self, serving: Any, sender: Any, replicas: int, host: str = "127.0.0.1",
                 options: CollectiveSync | None = None) -> None:
        self.serving, self.sender = serving, sender
        self.replicas, self.host = replicas, host
        self.options = options or CollectiveSync()
        self.port = 0
        self.spec: list[tuple[str, list[int], str]] | None = None
        self.last_reports: list[Any] = []  # SyncReport per replica after a checked sync
        self._gpu: dict[str, Any] | None = None  # the GPU path's payload, once planned
        self._adapters: bool | None = None  # the sender sends adapter versions (once known)

    def publish(self, version: int) -> bool:
        if self.options.backend == "gloo" and self.options.layout == "auto":
            ok = self._publish_gloo(version)  # one gloo group, one flat buffer per dtype
        else:  # planned: buckets, a named group (NCCL, or gloo with an explicit layout)
            ok = self._publish_gpu(version)
        if ok and self.options.checksum:
            self.last_reports = self._verify(version)
        return ok

    def _publish_gloo(self, version: int) -> bool:
        import ray

        pub = self.serving.publisher
        extra: dict[str, Any] = {"checksum": True} if self.options.checksum else {}
        if self._adapters is not False:  # an adapter version: its shape and checksum
            described = ray.get(self.sender.weights.remote(Describe()))
            self._adapters = bool(described)
            extra |= described
        if not self.port:
            ranks = ray.get(pub.wait_registered.remote(self.replicas, 300.0))
            self.port = free_port(self.host)
            self.spec = ray.get(self.sender.weights.remote(Spec()))
            payload = {"kind": "collective", "host": self.host, "port": self.port,
                       "world": self.replicas + 1, "ranks": ranks, "spec": self.spec, **extra}
            joined = self.sender.weights.remote(OpenGroup(self.host, self.port, self.replicas + 1))
            if not ray.get(pub.publish_collective.remote(version, payload)):
                return False
            ray.get(joined)
        else:
            payload = {"kind": "collective", "host": self.host, "port": self.port,
                       "world": self.replicas + 1, "spec": self.spec, **extra}
            if not ray.get(pub.publish_collective.remote(version, payload)):
                return False
        ray.get(self.sender.weights.remote(Send()))
        return True

    def _plan_gpu(self) -> dict[str, Any]:
        import ray


        o, pub = self.options, self.serving.publisher
        ray.get(pub.wait_registered.remote(self.replicas, 300.0))
        members: dict[str, dict[str, Any]] = ray.get(pub.members.remote())
        sender_gpu = ray.get(self.sender.weights.remote(GpuUuid()))
        shared = sorted(r for r, m in members.items() if sender_gpu and m.get("gpu") == sender_gpu)
        if shared and (o.ipc == "never" or len(shared) < len(members)):
            raise RuntimeError(
                f"engine replicas {shared} share GPU {sender_gpu} with trainer rank 0: NCCL "
                "cannot put two ranks on one GPU. Colocate every replica with rank 0 (CUDA IPC, "
                "train.weight_sync.ipc='auto') or give the engines GPUs of their own")
        self.spec = ray.get(self.sender.weights.remote(Spec()))
        layout = o.layout
        if layout == "auto":
            native = all(m.get("layout") == "per_tensor" for m in members.values())
            layout = "per_tensor" if native else "flat"
        base = {"kind": "collective", "planned": True, "checksum": o.checksum, "layout": layout,
                "width": max((int(m.get("width", 1)) for m in members.values()), default=1)}
        if shared:
            return {**base, "backend": "ipc", "names": [n for n, _, _ in self.spec]}
        host, port = ray.get(self.sender.weight_group_address.remote())
        world = 1 + sum(int(m.get("width", 1)) for m in members.values())
        group = f"{o.group_name}-{port}"
        payload = {**base, "backend": o.backend, "host": host, "port": port, "world": world,
                   "group_name": group, "buckets": plan_buckets(self.spec, o.bucket_mb),
                   "ranks": {r: m["offset"] for r, m in members.items()}}
        payload["joined"] = self.sender.weights.remote(
            OpenGroup(host, port, world, o.backend, group))
        return payload

    def _publish_gpu(self, version: int) -> bool:
        import ray

        pub = self.serving.publisher
        first = self._gpu is None
        if self._gpu is None:
            self._gpu = self._plan_gpu()
        payload = {k: v for k, v in self._gpu.items() if k != "joined"}
        if payload["backend"] == "ipc":
            payload["ipc"] = ray.get(self.sender.weights.remote(Ipc(payload["width"])))
            if not ray.get(pub.publish_collective.remote(version, payload)):
                return False
            try:  # the shared tensors must outlive every engine's copy
                ray.get(pub.wait_applied.remote(version, self.replicas, 600.0))
            finally:
                ray.get(self.sender.weights.remote(ReleaseIpc()))
            return True
        payload["first"] = first
        if not ray.get(pub.publish_collective.remote(version, payload)):
            return False
        if first:
            ray.get(self._gpu["joined"])
        ray.get(self.sender.weights.remote(Send(payload["buckets"], payload["layout"])))
        return True

    def _verify(self, version: int) -> list[Any]:
        """Compare each replica's checksums of what it now serves with the sender's."""

        import ray


        log = logging.getLogger("rl360.weights")
        pub = self.serving.publisher
        reports = ray.get(pub.wait_checksums.remote(version, self.replicas, 600.0))
        names = [n for n, _, _ in self.spec or []]
        out = []
        for replica, rep in sorted(reports.items()):
            sums = rep["sums"]
            limits = {n: (sums[n][0] if n in sums else None) for n in names}
            ours = ray.get(self.sender.weights.remote(Checksums(limits, rep.get("dtype"))))
            report = compare_checksums(ours, {n: v[1] for n, v in sums.items()},
                                       version=version, replica=replica)
            (log.info if report.ok else log.error)("weight checksum: %s", report.summary())
            out.append(report)
        return out


def build_transport(sync: WeightSync, serving: Any, trainer: Any, replicas: int, *,
                    dtype: str | None = None, inplace: bool = True,
                    say: Callable[[str], None] | None = None) -> WeightTransport:
    """The transport of the recipe's [train.weight_sync] for a trainer group and `replicas`
    engine replicas (the sender is the group's rank 0; with `sharded`, every rank). `dtype`:
    the engines' dtype; `inplace`: the engines are torch backends that load packed versions
    in place (deltas); `say`: where a sharded sync's one-line failure reports go."""
    if isinstance(sync, CollectiveSync) and sync.sharded:
        return ShardedTransport(serving, trainer, replicas, sync, dtype=dtype, say=say)
    if isinstance(sync, CollectiveSync):
        return CollectiveTransport(serving, trainer.workers[0], replicas, options=sync)
    return ObjectStoreTransport(serving, trainer, sync, dtype=dtype, inplace=inplace)
