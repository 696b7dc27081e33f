"""The calls a transport sends a trainer rank's weight sender (rl360.weights.sender, whose
docstring says which transport sends which), and `sender_env`, the environment the sender's
process starts with. Apart from the sender so that the driver and the transports, which only
build these, do not import torch."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import msgspec

from rl360.recipe import ObjectStoreSync, WeightSync
from rl360.weights.slots import writer_env, writes_slots


class Pack(msgspec.Struct, tag="pack"):
    """Put `version` into the object store (or a weight slot) and announce it to `publisher`
    (the WeightPublisher handle; None: only put it). `packer`: the transport's settings, the
    first call's kept (rl360.weights.packing.make_sender)."""

    version: int
    packer: dict[str, Any]
    publisher: Any = None


class Spec(msgspec.Struct, tag="spec"):
    """The (name, shape, dtype) of every tensor sent, in order."""


class OpenGroup(msgspec.Struct, tag="open_group"):
    """Join a collective group as its rank 0: gloo with flat per-dtype buffers when
    `group_name` is empty, else a named group (NCCL, or gloo with a planned layout)."""

    host: str
    port: int
    world: int
    backend: str = "gloo"
    group_name: str = ""


class Send(msgspec.Struct, tag="send"):
    """Broadcast the weights to the group: all at once (gloo) or by `buckets` (named group)."""

    buckets: list[Any] | None = None
    layout: str = "flat"


class GpuUuid(msgspec.Struct, tag="gpu_uuid"):
    """The sender's GPU ("" without one)."""


class Ipc(msgspec.Struct, tag="ipc"):
    """The weights on the sender's GPU as CUDA IPC handles, once per tensor-parallel rank."""

    ranks: int


class ReleaseIpc(msgspec.Struct, tag="release_ipc"):
    """Every engine copied the shared tensors: let them go."""


class Describe(msgspec.Struct, tag="describe"):
    """{"adapter": {rank, alpha, targets, checksum}} in adapter mode, else {}."""


class ShardLayout(msgspec.Struct, tag="shard_layout"):
    """This rank's part of a sharded sync's plan: its pieces of the weights, cast to `dtype`,
    in buckets of at most `bucket_mb` (rl360.weights.shards.RankPart)."""

    dtype: str | None
    bucket_mb: float


class ShardListen(msgspec.Struct, tag="shard_listen"):
    """Open the rendezvous of epoch `epoch`'s group (this rank + `world` - 1 replicas);
    returns (host, port)."""

    epoch: int
    world: int
    timeout_s: float


class ShardSend(msgspec.Struct, tag="shard_send"):
    """Broadcast this rank's buckets of the current weights as `version` over epoch `epoch`'s
    group (formed first if new, within `form_timeout_s`; each bucket within `timeout_s`)."""

    epoch: int
    version: int
    backend: str
    form_timeout_s: float
    timeout_s: float
    checksum: bool = True


class ShardChecksums(msgspec.Struct, tag="shard_checksums"):
    """This rank's parts of the per-tensor checksums of what it sends (the checksum option of
    a sharded sync; rl360.weights.shards.full_checksums adds them up)."""


class Gather(msgspec.Struct, tag="gather"):
    """Every rank at once: gather the full weights into rank 0's copy (a trainer that keeps
    none, for the full-gather path); returns rank 0's bytes."""


class Rss(msgspec.Struct, tag="rss"):
    """This process's resident bytes and their peak since the last reset ({"rss", "peak"});
    `reset`: start a new peak here (what a sharded send measures of itself; benches ask it of
    the other paths)."""

    reset: bool = False


class Checksums(msgspec.Struct, tag="checksums"):
    """The sender's checksums, per name up to `limits[name]` elements, cast to `dtype`."""

    limits: dict[str, int | None]
    dtype: str | None


SenderCall = (Pack | Spec | OpenGroup | Send | GpuUuid | Ipc | ReleaseIpc | Checksums | Describe
              | ShardLayout | ShardListen | ShardSend | ShardChecksums | Gather | Rss)


def sender_env(sync: WeightSync, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Environment variables for the process that sends weights by `sync` (trainer rank 0):
    when it writes weight slots, its large copies use streaming stores (slots.writer_env)."""
    writes = isinstance(sync, ObjectStoreSync) and writes_slots(sync.slots, sync.zero_copy,
                                                                sync.delta)
    return writer_env(environ) if writes else {}
