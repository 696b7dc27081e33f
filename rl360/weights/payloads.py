"""What an engine receives for a weight version: one tagged union, `WeightUpdate`.

Every transport ends in one of these, handed to the engine's `update_weights` (the receiver
protocol, rl360.weights.receiver) by its replica's follow loop (rl360.weights.follow):

- `TensorUpdate` ("tensors"): a full version as name -> tensor, which the engine copies into its
  own weights: a version the replica received over gloo or NCCL, loaded from CUDA IPC handles,
  a state dict out of the object store, or the views of a packed full version for an engine
  that loads state dicts.
- `FullUpdate` ("full"), `SlotUpdate` ("slot"), `DeltaUpdate` ("delta"): a version packed by
  `WeightPacker` (rl360.weights.packing) for an engine that loads it into its own parameters in
  place: a full version out of the object store, a full version in a weight slot (shared memory
  the sender rewrites, rl360.weights.slots), or deltas on top of the engine's own weights (with
  the chain's full base when the engine is behind it).
- `CollectiveUpdate` ("collective"), `IpcUpdate` ("ipc"): a version an engine with a weight
  group of its own (SGLang) receives in its workers: the group's buckets, or CUDA IPC handles
  per tensor-parallel rank.
- `AdapterUpdate` ("adapter"): a LoRA adapter version (`trainer.lora`): the engine serves its
  own base weights (the model it loaded) plus this adapter. Complete by itself (no deltas): a
  replica that missed versions loads the newest. Its tensors arrive through the object store
  (`AdapterPacket`, rl360.weights.adapters) or the gloo collective, checked against the
  sender's checksum before any engine sees them.

A new kind of version (an adapter, say) is one more Struct with its own tag in the union, and
a case in the engines that take it. Nothing here imports torch or numpy: the engine contract,
the publisher and the session shards import this module and start without them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import numpy as np


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a torch dtype named as `str(dtype)` ("torch.bfloat16": 2): the width
    its name states, sub-byte types stored one to a byte."""
    name = dtype.removeprefix("torch.")
    if name == "bool":
        return 1
    bits = re.search(r"\d+", name)
    if bits is None:
        raise ValueError(f"unknown tensor dtype {dtype!r} in a weight version")
    return max(1, int(bits.group()) // 8)


class Entry(msgspec.Struct, array_like=True):
    name: str
    shape: list[int]
    dtype: str  # torch dtype as str(), e.g. "torch.bfloat16"
    numel: int


class Layout(msgspec.Struct):
    """The tensors of a version in send order, and which of them each bucket holds."""

    entries: list[Entry]
    buckets: list[list[int]]  # entry indices per bucket

    @property
    def nbytes(self) -> int:
        return sum(e.numel * dtype_bytes(e.dtype) for e in self.entries)


@dataclass
class FullPacket:
    """A full version as the object store (or a weight slot) holds it."""

    version: int
    arrays: list[np.ndarray]  # raw bits of each entry, in layout order
    checksums: list[int]  # per bucket ([] when the sender sends no deltas)
    # replicas may serve these arrays as their parameters (no delta will be applied to them)
    shareable: bool = False
    mapped: bool = False  # replica side: its pages are mapped in this process already


@dataclass
class DeltaPacket:
    """The bits of a version that changed since the one before it."""

    version: int
    base: int  # the version this delta applies to
    entries: list[int]  # changed entries (layout indices)
    positions: list[np.ndarray]  # element positions whose bits changed, per changed entry
    values: list[np.ndarray]  # their new raw bits
    checksums: list[int]  # per bucket, of the state after this delta


@dataclass
class AdapterPacket:
    """An adapter version as the object store holds it: the adapter's shape (rank, alpha,
    targets), its tensors' raw bits in `entries` order and the xxh3-64 of those bits."""

    version: int
    rank: int
    alpha: float
    targets: list[str]
    entries: list[Entry]  # `<projection>.lora_A.weight` [r, in], `<projection>.lora_B.weight`
    arrays: list[np.ndarray]
    checksum: int

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)


class TensorUpdate(msgspec.Struct, tag="tensors"):
    """A full version as name -> tensor, copied into the engine's weights."""

    tensors: dict[str, Any]


class PackedUpdate(msgspec.Struct, kw_only=True):
    """A packed version for one replica that loads it in place (rl360.weights.packing.
    apply_packed): the full base (None when the replica's own weights are the base) and the
    deltas to apply after it. `fetch_full()` returns the chain's full base and its deltas
    (blocking; used when the checksums say the replica's weights are not what the sender
    diffed against). The apply fills in what it did and took."""

    version: int
    layout: Layout
    full: FullPacket | None = None
    deltas: list[DeltaPacket] = []
    fetch_full: Callable[[], tuple[FullPacket, list[DeltaPacket]]] | None = None
    fell_back: bool = False
    apply_s: float = 0.0  # wall and CPU (the applying thread) seconds of the apply
    apply_cpu_s: float = 0.0
    borrowed: int = 0  # parameters that now view the version (zero copy), 0: copied

    def detail(self) -> dict[str, Any]:
        """What this replica fetched for the version (reported to the publisher)."""
        moved = (self.layout.nbytes if self.full is not None else 0) + sum(
            p.nbytes + v.nbytes for d in self.deltas for p, v in zip(d.positions, d.values,
                                                                     strict=True))
        return {"full": self.full is not None, "deltas": len(self.deltas), "bytes": moved,
                "fell_back": self.fell_back, "apply_s": self.apply_s,
                "apply_cpu_s": self.apply_cpu_s, "borrowed": self.borrowed}


class FullUpdate(PackedUpdate, tag="full"):
    """A full version out of the object store."""


class SlotUpdate(PackedUpdate, tag="slot", kw_only=True):
    """A full version in a weight slot, served in place."""

    slot: str  # the slot's id


class DeltaUpdate(PackedUpdate, tag="delta"):
    """Deltas on top of the replica's weights, or of the chain's full base (`full`)."""


class CollectiveUpdate(msgspec.Struct, tag="collective"):
    """A version arriving over the collective group: the engine receives `buckets` in order
    (each one update_weights_from_distributed call, one broadcast per tensor)."""

    group_name: str
    buckets: list[list[tuple[str, list[int], str]]]
    join: tuple[str, int, int, int, str] | None = None  # (host, port, rank_offset, world, backend)


class IpcUpdate(msgspec.Struct, tag="ipc"):
    """Weights on the engine's own GPU, shared by CUDA IPC: one ForkingPickler payload of
    [(name, cuda tensor)] per tensor-parallel rank (the sender keeps the tensors alive)."""

    serialized_per_rank: list[bytes]


class AdapterUpdate(msgspec.Struct, tag="adapter", kw_only=True):
    """A LoRA adapter version: the engine's base weights plus (alpha / rank) * B @ A on every
    projection named in `targets`; `tensors` maps `<projection>.lora_A.weight` ([rank, in]) and
    `<projection>.lora_B.weight` ([out, rank]) to tensors (checked against `checksum`, the
    sender's xxh3-64 of their raw bits, before the update was made)."""

    rank: int
    alpha: float
    targets: list[str]
    tensors: dict[str, Any]
    checksum: int = 0
    nbytes: int = 0  # bytes the replica fetched or received for it

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def detail(self) -> dict[str, Any]:
        """What this replica fetched for the version (reported to the publisher)."""
        return {"adapter": True, "full": False, "deltas": 0, "bytes": self.nbytes}


WeightUpdate = (TensorUpdate | FullUpdate | SlotUpdate | DeltaUpdate | CollectiveUpdate
                | IpcUpdate | AdapterUpdate)


def refuse(backend: str, update: WeightUpdate, takes: str) -> TypeError:
    """The error of an engine handed a kind of version it does not take."""
    tag = type(update).__struct_config__.tag if isinstance(update, msgspec.Struct) else None
    return TypeError(f"the {backend} engine takes {takes} weight versions, not "
                     f"{tag or type(update).__name__!r}")
