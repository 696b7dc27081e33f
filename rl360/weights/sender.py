"""The sender: what a trainer rank holds to send its weights to the engines.

Trainer rank 0 (rl360.actors.trainer_group.TrainerWorker) holds a `WeightSender` built over two
views of its trainer's weights, and the transports (rl360.weights.transports) drive it through
the rank's one remote method, `weights(call)`, with a `SenderCall`:

- object store: `Pack` puts a version into the object store, or into a weight slot, as one
  packed object and announces it to the publisher (rl360.weights.packing, .slots);
- gloo collective: `Spec`, `OpenGroup`, then `Send` per version (rl360.weights.gloo);
- GPU collective: `GpuUuid`, `OpenGroup` with a group name and `Send` with buckets (NCCL), or
  `Ipc` / `ReleaseIpc` when the engines share the sender's GPU (rl360.weights.nccl);
- the checksum option: `Checksums` of what the sender sent;
- `Describe`: what a collective payload says of the version besides its tensors (an adapter's
  shape and checksum; nothing for full versions);
- sharded collective (every rank, `train.weight_sync.sharded`): `ShardLayout`, then per epoch
  of membership `ShardListen`, and `ShardSend` per version (rl360.weights.shards); `Gather`
  gathers the full weights into rank 0's copy on demand (every rank: a collective).

With `trainer.lora` the sender is in adapter mode (`adapter`: the adapter's rank, alpha and
targets): its state is the adapter's tensors, `Pack` puts an adapter version
(rl360.weights.adapters) and the gloo collective broadcasts the adapter.

The calls are defined in rl360.weights.sender_calls (torch-free: the driver and the transports
build them), with `sender_env`, the environment the sender's process starts with. A bench or a
test stands in for a trainer rank by holding a WeightSender over a state dict.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rl360.weights.adapters import describe, pack_adapter, put_adapter
from rl360.weights.gloo import GlooGroup, tensor_spec
from rl360.weights.nccl import GroupSender, gpu_uuid
from rl360.weights.packing import WeightPacker, make_sender, put_packet
from rl360.weights.sender_calls import (
    Checksums,
    Describe,
    Gather,
    GpuUuid,
    Ipc,
    OpenGroup,
    Pack,
    ReleaseIpc,
    Rss,
    Send,
    SenderCall,
    ShardChecksums,
    ShardLayout,
    ShardListen,
    ShardSend,
    Spec,
)
from rl360.weights.shard_groups import ShardSender, current_rss, peak_rss, reset_peak_rss
from rl360.weights.slots import SlotWriter

if TYPE_CHECKING:
    from torch import Tensor

State = Callable[[], Mapping[str, "Tensor"]]


class WeightSender:
    """A trainer rank's end of weight sync.

    `views()`: the weights under HF names, views allowed (whoever sends copies them once anyway:
    into the object store, a weight slot or a socket). `snapshot()`: a copy safe to keep while
    the trainer steps (the GPU paths, the spec and the checksums); `views` when not given.
    `adapter`: adapter mode (rank, alpha, targets; rl360.policies.lora.LoraSpec), `views` then
    gives the adapter's tensors. `held()`: the weights this rank holds, as it holds them
    (DTensor shards for fsdp), for sharded syncs from every rank (`rank` of `world`);
    `gather()`: the trainer's collective full gather (rank 0 keeps the copy)."""

    def __init__(self, views: State, snapshot: State | None = None, adapter: Any = None, *,
                 held: State | None = None, rank: int = 0, world: int = 1,
                 gather: Callable[[], int] | None = None) -> None:
        self.views = views
        self.snapshot = snapshot or views
        self.adapter = adapter
        self._packer: WeightPacker | None = None
        self._slots: SlotWriter | None = None
        self._gloo: GlooGroup | None = None
        self._group: GroupSender | None = None
        self._held, self._gather = held, gather
        self.rank, self.world = rank, world
        self._shards: ShardSender | None = None

    def handle(self, call: SenderCall) -> Any:
        """Run one call (what the rank's remote `weights` method does)."""
        match call:
            case Pack(version, packer, publisher):
                return self.pack(version, packer, publisher)
            case Spec():
                return self.spec()
            case OpenGroup(host, port, world, backend, group_name):
                return self.open_group(host, port, world, backend, group_name)
            case Send(buckets, layout):
                return self.send(buckets, layout)
            case GpuUuid():
                return gpu_uuid()
            case Ipc(ranks):
                return self.group().ipc_payload(ranks)
            case ReleaseIpc():
                return self.group().release_ipc()
            case Checksums(limits, dtype):
                return self.group().checksums(limits, dtype)
            case Describe():
                return self.describe()
            case ShardLayout(dtype, bucket_mb):
                return self.shards().layout(dtype, bucket_mb)
            case ShardListen(epoch, world, timeout_s):
                return self.shards().listen(epoch, _node_ip(), world, timeout_s)
            case ShardSend(epoch, version, backend, form_timeout_s, timeout_s, checksum):
                return self.shards().send(epoch, version, backend, form_timeout_s, timeout_s,
                                          checksum)
            case ShardChecksums():
                return self.shards().checksums()
            case Rss(reset):
                if reset:
                    reset_peak_rss()
                return {"rss": current_rss(), "peak": peak_rss()}
            case Gather():
                if self._gather is None:
                    raise RuntimeError("this trainer rank cannot gather its weights")
                return self._gather()
        raise TypeError(f"not a weight sender call: {call!r}")

    def pack(self, version: int, packer: dict[str, Any], publisher: Any = None
             ) -> dict[str, Any]:
        """Put `version` into the object store as one packed object, full or a delta against
        the version before, and publish it to `publisher` when given; returns its metadata.
        `packer`: WeightPacker's settings and "slots" (the first call's are kept; full
        versions served in place go through weight slots). In adapter mode: the adapter
        version, cast to the packer's dtype."""
        if self.adapter is not None:
            t0, c0 = time.perf_counter(), time.process_time()
            packet = pack_adapter(version, self.adapter, self.views(), packer.get("dtype"))
            timing = {"pack_s": time.perf_counter() - t0, "pack_cpu_s": time.process_time() - c0}
            return {**put_adapter(packet, publisher), **timing}
        if self._packer is None:
            self._packer, self._slots = make_sender(packer)
        state = self.views()
        meta = put_packet(self._packer.pack(version, state), publisher, self._slots)
        if publisher is not None and not meta["published"] and meta.get("kind") == "delta":
            # the publisher lost the chain the delta extends (it restarted): send it full
            meta = put_packet(self._packer.repack_full(version, state), publisher)
        return meta

    def describe(self) -> dict[str, Any]:
        if self.adapter is None:
            return {}
        return {"adapter": describe(self.adapter, self.views())}

    def spec(self) -> list[tuple[str, list[int], str]]:
        return tensor_spec(dict(self.snapshot()))

    def open_group(self, host: str, port: int, world: int, backend: str = "gloo",
                   group_name: str = "") -> None:
        if not group_name:  # the CPU path: one gloo group, flat per-dtype buffers
            self._gloo = GlooGroup(host, port, 0, world)
            return
        self.group().open(host, port, world, backend, group_name)

    def send(self, buckets: list[Any] | None = None, layout: str = "flat") -> int:
        """Broadcast the weights to the group's engines; returns the bytes sent."""
        if buckets is None:
            if self._gloo is None:
                raise RuntimeError("send before open_group: the gloo group is not formed")
            state = dict(self.views())
            self._gloo.send(state)
            return sum(v.numel() * v.element_size() for v in state.values())
        return self.group().send(buckets, layout)

    def shards(self) -> ShardSender:
        """This rank's sharded sender (rl360.weights.shards), made at first use."""
        if self.adapter is not None:
            raise ValueError("train.weight_sync.sharded sends full weights; with trainer.lora "
                             "adapter versions go through rank 0 (sharded = false)")
        if self._held is None:
            raise ValueError("this trainer cannot send the weights it holds "
                             "(train.weight_sync.sharded needs trainer.backend fsdp or torch)")
        if self._shards is None:
            self._shards = ShardSender(self._held, self.rank, self.world)
        return self._shards

    def group(self) -> GroupSender:
        """The named group's sender (NCCL, CUDA IPC, checksums), made at first use."""
        if self._group is None:
            self._group = GroupSender(lambda: dict(self.snapshot()))
        return self._group


def _node_ip() -> str:
    """This node's address for a group's rendezvous (loopback outside Ray)."""
    try:
        import ray

        return str(ray.util.get_node_ip_address()) if ray.is_initialized() else "127.0.0.1"
    except Exception:
        return "127.0.0.1"
