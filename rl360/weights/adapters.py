"""Adapter versions: with `trainer.lora` a weight version is the LoRA adapter alone.

The engines keep the base weights they loaded and take each version as an `AdapterUpdate`
(rl360.weights.payloads): for SmolLM2-135M with rank-16 adapters on its 7 attention and MLP
projections that is 4.88M parameters against 134.5M (about 27x fewer bytes in the same dtype;
the ratio is the model's, not the transport's: rank x (in + out) per projection against
in x out). An adapter version is complete by itself, so there are no deltas and no weight
slots: a replica that missed versions loads the newest one.

Sender (trainer rank 0, rl360.weights.sender.WeightSender in adapter mode):
- object store: `pack_adapter` casts the tensors to the engines' dtype, takes their raw bits and
  an xxh3-64 checksum over them; `put_adapter` puts the `AdapterPacket` into the object store
  and announces {"kind": "adapter", "ref", ...} to the publisher;
- gloo collective: the adapter's tensors are the state the group broadcasts, and the payload
  carries the adapter's shape and checksum (`describe`).
Replica (rl360.weights.follow): `unpack_adapter` / `received_adapter` check the checksum and make
the AdapterUpdate; a mismatch raises `AdapterChecksumError` and the replica keeps serving the
version it has (the next announcement is tried again).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from rl360.weights.packing import from_raw, raw
from rl360.weights.payloads import AdapterPacket, AdapterUpdate, Entry


class AdapterChecksumError(ValueError):
    """An adapter version's tensors are not the bits the sender checksummed."""


def adapter_checksum(arrays: list[np.ndarray]) -> int:
    """xxh3-64 over the arrays' raw bytes, in order."""
    h = xxhash.xxh3_64()
    for a in arrays:
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return int(h.intdigest())


def _cast(t: torch.Tensor, dtype: str | None) -> torch.Tensor:
    if dtype and t.is_floating_point():
        return t.detach().to(getattr(torch, dtype.removeprefix("torch.")))
    return t.detach()


def pack_adapter(version: int, spec: Any, tensors: Mapping[str, torch.Tensor],
                 dtype: str | None = None) -> AdapterPacket:
    """The adapter's tensors as one object-store packet (cast to `dtype`, e.g. "bfloat16": the
    engines'). `spec`: rank, alpha, targets (rl360.policies.lora.LoraSpec)."""
    entries, arrays = [], []
    for name in sorted(tensors):
        t = _cast(tensors[name], dtype).contiguous()
        entries.append(Entry(name, list(t.shape), str(t.dtype), t.numel()))
        arrays.append(raw(t))
    return AdapterPacket(version=version, rank=int(spec.rank), alpha=float(spec.alpha),
                         targets=sorted(spec.targets), entries=entries, arrays=arrays,
                         checksum=adapter_checksum(arrays))


def put_adapter(packet: AdapterPacket, publisher: Any = None) -> dict[str, Any]:
    """Put the packet into the object store and announce it to `publisher` (the
    WeightPublisher handle) when given; returns the version's metadata (kind, bytes, timings,
    "published"; with no publisher the wrapped ref, as rl360.weights.packing.put_packet)."""
    import ray

    t0, c0 = time.perf_counter(), time.process_time()
    payload = {"kind": "adapter", "version": packet.version, "nbytes": packet.nbytes,
               "ref": ray.put(packet)}
    meta = {"kind": "adapter", "version": packet.version, "nbytes": packet.nbytes,
            "put_s": time.perf_counter() - t0, "put_cpu_s": time.process_time() - c0}
    if publisher is None:
        return {**meta, "ref": [payload["ref"]]}
    meta["published"] = bool(ray.get(publisher.publish.remote(packet.version, payload)))
    return meta


def unpack_adapter(packet: AdapterPacket) -> AdapterUpdate:
    """The update of a fetched packet, its checksum checked (tensors view the packet's arrays)."""
    if adapter_checksum(packet.arrays) != packet.checksum:
        raise AdapterChecksumError(f"adapter version {packet.version}: checksum mismatch "
                                   "(the fetched bits are not the ones sent)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only object-store memory
        tensors = {e.name: from_raw(a, e) for e, a in zip(packet.entries, packet.arrays,
                                                          strict=True)}
    return AdapterUpdate(rank=packet.rank, alpha=packet.alpha, targets=list(packet.targets),
                         tensors=tensors, checksum=packet.checksum, nbytes=packet.nbytes)


def describe(spec: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What a collective payload says of an adapter version: its shape and the checksum of the
    tensors as sent (their own dtype, sorted by name)."""
    arrays = [raw(tensors[n].detach().contiguous()) for n in sorted(tensors)]
    return {"rank": int(spec.rank), "alpha": float(spec.alpha),
            "targets": sorted(spec.targets), "checksum": adapter_checksum(arrays)}


def received_adapter(state: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
                     ) -> AdapterUpdate:
    """The update of adapter tensors received over a collective group, checked against the
    payload's `describe` (raises AdapterChecksumError)."""
    arrays = [raw(state[n].detach().contiguous()) for n in sorted(state)]
    got = adapter_checksum(arrays)
    if got != int(meta["checksum"]):
        raise AdapterChecksumError("adapter version received over the group: checksum mismatch")
    return AdapterUpdate(rank=int(meta["rank"]), alpha=float(meta["alpha"]),
                         targets=list(meta["targets"]), tensors=dict(state), checksum=got,
                         nbytes=sum(int(a.nbytes) for a in arrays))
