"""Packed weight versions for the object-store transport: one object per version, zero-copy
views on the replicas, loading in place, and delta versions against the previous one.

Sender (`WeightPacker`, on trainer rank 0): a version is either FULL (every tensor's raw bytes,
cast to the engines' dtype, as numpy arrays that Ray writes out-of-band into ONE contiguous
object) or a DELTA against the version before it: per changed tensor the positions whose bits
differ (int32/int64) and the new raw values there. bf16 RL steps leave ~99% of elements
bit-identical, so a delta is a few percent of a full version. Each packet carries an xxh3
checksum per bucket (consecutive tensors of <= bucket_mb) of the state it leads to.

Replica (`apply_packed(update, model)`, the update a FullUpdate, SlotUpdate or DeltaUpdate of
rl360.weights.payloads): a full version of a sender that sends no deltas
(`FullPacket.shareable`, the default `zero_copy`) is served straight out of the object store:
each parameter becomes a read-only view of the version's object (`borrow_full`, a pointer swap:
no copy, and all replicas of a node share one copy of the weights); the object stays pinned
while a view of it lives and is released when the next version replaces them. Otherwise a full
version is copied into the existing parameters (`copy_`), deltas are applied in place
(`index_put_` on the raw bits), then every bucket's checksum is checked against the
parameters. Nothing ever writes into a borrowed view: any load that writes first gives the
model private copies again (`own_weights`). A mismatch (a replica that drifted or applied
onto the wrong base) falls back to the full version of the chain plus its deltas, all before the
engine serves again. The publisher keeps the chain (full base + deltas since); a replica that
missed versions applies the deltas it lacks, or starts again from the full base.

A full version is sent instead of a delta for the first version, when the delta would exceed
`max_delta_fraction` of a full one, or when the deltas since the last full would.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch
import xxhash

from rl360.weights.payloads import (
    DeltaPacket,
    DeltaUpdate,
    Entry,
    FullPacket,
    FullUpdate,
    Layout,
    PackedUpdate,
    SlotUpdate,
    dtype_bytes,
)
from rl360.weights.slots import SlotReader, SlotWriter, writes_slots

log = logging.getLogger("rl360.weights")

_RAW_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_RAW_NUMPY = {n: torch.empty(0, dtype=t).numpy().dtype for n, t in _RAW_TORCH.items()}


@dataclass
class Packet:
    kind: str  # "full" | "delta"
    data: FullPacket | DeltaPacket
    layout: Layout
    nbytes: int  # bytes a replica fetches for this version
    pack_s: float = 0.0  # wall and CPU seconds the sender took to pack it (diff, checksums)
    pack_cpu_s: float = 0.0

    def meta(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "version": self.data.version,
                               "nbytes": self.nbytes, "pack_s": self.pack_s,
                               "pack_cpu_s": self.pack_cpu_s}
        if isinstance(self.data, DeltaPacket):
            out["base"] = self.data.base
        else:
            out["layout"] = msgspec.to_builtins(self.layout)
        return out


def raw(t: torch.Tensor) -> np.ndarray:
    """The tensor's bits as a flat numpy array of same-width integers (no copy when the tensor
    is a contiguous CPU tensor); numpy has no bfloat16, bits do."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(_RAW_TORCH[flat.element_size()]).numpy()


def from_raw(arr: np.ndarray, entry: Entry) -> torch.Tensor:
    """A tensor view (no copy) of raw bits, e.g. out of the object store (read-only memory:
    only ever read from it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        t = torch.from_numpy(arr)
    return t.view(getattr(torch, entry.dtype.removeprefix("torch."))).view(entry.shape)


def _np(arr: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def build_layout(state: Mapping[str, torch.Tensor], bucket_mb: float) -> Layout:
    limit = int(bucket_mb * 1024 * 1024)
    entries: list[Entry] = []
    buckets: list[list[int]] = []
    size = 0
    for i, (name, t) in enumerate(state.items()):
        entries.append(Entry(name, list(t.shape), str(t.dtype), t.numel()))
        b = t.numel() * t.element_size()
        if not buckets or (buckets[-1] and size + b > limit):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += b
    return Layout(entries=entries, buckets=buckets)


def bucket_checksums(layout: Layout, arrays: list[np.ndarray]) -> list[int]:
    """xxh3-64 of each bucket's raw bytes, entries in order (~30 GB/s: cheap next to a copy)."""
    out = []
    for bucket in layout.buckets:
        h = xxhash.xxh3_64()
        for i in bucket:
            h.update(arrays[i])
        out.append(h.intdigest())
    return out


def _cast(state: Mapping[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
    """The state as the engines hold it: floating tensors in `dtype` (None: as they are)."""
    if not dtype:
        return dict(state)
    target = getattr(torch, dtype.removeprefix("torch."))
    return {k: (v.to(target) if v.is_floating_point() and v.dtype != target else v)
            for k, v in state.items()}


@dataclass
class WeightPacker:
    """Sender side. `delta=False`: every version full, straight from the state's memory (the
    object store write is the only copy). `delta=True`: keeps the last version's bits (one
    copy of the weights) to diff the next one against."""

    delta: bool = False
    max_delta_fraction: float = 0.25
    bucket_mb: float = 64.0
    dtype: str | None = None  # the engines' dtype ("bfloat16", ...); None: as the trainer has it
    zero_copy: bool = True  # full versions without deltas: replicas serve them in place
    layout: Layout | None = None
    prev: list[np.ndarray] | None = None
    version: int = 0
    chain_bytes: int = 0  # delta bytes since the last full version
    stats: dict[str, int] = field(default_factory=lambda: {"full": 0, "delta": 0})

    def pack(self, version: int, state: Mapping[str, torch.Tensor]) -> Packet:
        if version <= self.version:
            raise ValueError(f"weight version {version} is not after {self.version}")
        t0, c0 = time.perf_counter(), time.process_time()
        state = _cast(state, self.dtype)
        layout = build_layout(state, self.bucket_mb)
        arrays = [raw(v.cpu()) for v in state.values()]
        same = self.layout is not None and self.layout.entries == layout.entries
        packet = None
        if self.delta and same and self.prev is not None:
            packet = self._delta(version, layout, arrays)
        if packet is None:
            packet = self._full(version, layout, arrays)
        packet.pack_s, packet.pack_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        return packet

    def repack_full(self, version: int, state: Mapping[str, torch.Tensor]) -> Packet:
        """`version` (already packed as a delta) again as a full version: for a publisher
        that no longer holds the chain the delta extends."""
        state = _cast(state, self.dtype)
        layout = build_layout(state, self.bucket_mb)
        return self._full(version, layout, [raw(v.cpu()) for v in state.values()])

    def _full(self, version: int, layout: Layout, arrays: list[np.ndarray]) -> Packet:
        if self.delta:  # keep this version's bits to diff the next one against
            if self.prev is None or self.layout is None or self.layout.entries != layout.entries:
                self.prev = [a.copy() for a in arrays]
            else:
                for p, a in zip(self.prev, arrays, strict=True):
                    np.copyto(p, a)
            arrays = self.prev
        self.layout, self.version, self.chain_bytes = layout, version, 0
        self.stats["full"] += 1
        # checksums guard deltas (applied onto the replica's own weights): a full version
        # overwrites every element, so plain full syncs skip the pass over the weights
        data = FullPacket(version, arrays, bucket_checksums(layout, arrays) if self.delta else [],
                          shareable=self.zero_copy and not self.delta)
        return Packet("full", data, layout, layout.nbytes)

    def _delta(self, version: int, layout: Layout, arrays: list[np.ndarray]) -> Packet | None:
        assert self.prev is not None
        full = layout.nbytes
        budget = self.max_delta_fraction * full
        changed: list[int] = []
        positions: list[np.ndarray] = []
        size = 0
        for i, (new, old) in enumerate(zip(arrays, self.prev, strict=True)):
            pos = changed_positions(new, old)
            if not pos.size:
                continue
            pos = pos.astype(np.int32 if new.size < 2**31 else np.int64)
            size += pos.nbytes + pos.size * new.itemsize
            if size > budget or self.chain_bytes + size > budget:
                return None  # a full version is cheaper (or the chain is long enough)
            changed.append(i)
            positions.append(pos)
        values = [arrays[i][p] for i, p in zip(changed, positions, strict=True)]
        for i, p, v in zip(changed, positions, values, strict=True):
            self.prev[i][p] = v
        data = DeltaPacket(version, self.version, changed, positions, values,
                           bucket_checksums(layout, self.prev))
        self.version, self.chain_bytes = version, self.chain_bytes + size
        self.stats["delta"] += 1
        return Packet("delta", data, layout, size)


def make_sender(settings: Mapping[str, Any]) -> tuple[WeightPacker, SlotWriter | None]:
    """The sender side of a transport's packer settings: WeightPacker's fields, plus "slots"
    (how many weight slots full versions served in place may use; 0: none)."""
    kw = dict(settings)
    n = int(kw.pop("slots", 0))
    packer = WeightPacker(**kw)
    return packer, (SlotWriter(n) if writes_slots(n, packer.zero_copy, packer.delta) else None)


def changed_positions(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Positions where `new` and `old` (same-width integer bits) differ. Compares 8-byte words
    first (a bf16 tensor: 4 elements per comparison, 4x less mask to scan), then the elements
    of the words that changed."""
    k = 8 // new.itemsize
    whole = new.size - new.size % k
    if k == 1 or whole == 0:
        return np.flatnonzero(new != old)
    words = np.flatnonzero(new[:whole].view(np.int64) != old[:whole].view(np.int64))
    sub = new[:whole].reshape(-1, k)[words] != old[:whole].reshape(-1, k)[words]
    pos = (words[:, None] * k + np.arange(k))[sub]
    if whole < new.size:
        tail = np.flatnonzero(new[whole:] != old[whole:]) + whole
        pos = np.concatenate([pos, tail])
    return pos


def put_packet(packet: Packet, publisher: Any = None, slots: SlotWriter | None = None
               ) -> dict[str, Any]:
    """Put the packet's data into the object store (one object: Ray writes the numpy arrays
    out-of-band, back to back); returns the publisher's metadata with the ref wrapped in a
    list so Ray passes it on unresolved. With `publisher` (the WeightPublisher handle) the
    sender announces the version itself, one hop less than through the driver, and returns
    the metadata without the ref and with "published" and the seconds the put took (put_s,
    put_cpu_s: this process's CPU, the object store write). With `slots`, a version the
    replicas may serve in place is written into a free weight slot instead (rl360.weights.
    slots; "slot" in the metadata), and into the object store when none is free; after it the
    sender promises the slot of its next version and hands that hint to the publisher."""
    import ray

    t0, c0 = time.perf_counter(), time.process_time()
    if (slots is not None and publisher is not None and isinstance(packet.data, FullPacket)
            and packet.data.shareable):
        base = packet.meta()
        reserved = slots.reserve(packet.data.arrays, base["layout"])
        if reserved is not None:
            slot, desc = reserved
            meta = {**base, "ref": [desc]}
            slots.fill(slot, packet.data.arrays, packet.data.version)
            timing = {"put_s": time.perf_counter() - t0, "put_cpu_s": time.process_time() - c0}
            answer = ray.get(publisher.publish_slot.remote(packet.data.version, meta))
            if slots.published(answer, desc["slot"]):
                promised = slots.promise(base["layout"])
                if promised is not None:  # nothing waits on it: a lost hint costs the hops
                    publisher.hint_slot.remote(packet.data.version, promised)
                return {**{k: v for k, v in meta.items() if k != "ref"}, "published": True,
                        "slot": desc["slot"], **timing}
            log.info("weight version %d: slot refused (%s); through the object store",
                     packet.data.version, answer.get("why") or answer.get("stop"))
    if slots is not None:
        slots.broken_promise()  # a version outside the slots: the hint handed out is stale
    meta = {**packet.meta(), "ref": [ray.put(packet.data)]}
    timing = {"put_s": time.perf_counter() - t0, "put_cpu_s": time.process_time() - c0}
    if publisher is None:
        return meta
    ok = bool(ray.get(publisher.publish_packed.remote(packet.data.version, meta)))
    return {**{k: v for k, v in meta.items() if k != "ref"}, "published": ok, **timing}


# ----------------------------------------------------------------------------- replica side


class ChecksumMismatch(RuntimeError):
    pass


def _params(model: Any, layout: Layout) -> dict[str, torch.Tensor]:
    held = model.state_dict()
    missing = [e.name for e in layout.entries if e.name not in held]
    if missing:
        raise ValueError(f"weight update has tensors the model lacks: {missing[:5]}")
    for e in layout.entries:
        if list(held[e.name].shape) != e.shape:
            raise ValueError(f"weight update {e.name}: shape {e.shape} != "
                             f"{list(held[e.name].shape)}")
    return held


_BORROWED = "_rl360_borrowed"  # model attribute: names of parameters that view a version


def borrow_full(model: Any, layout: Layout, full: FullPacket) -> int:
    """Serve `full` in place: every parameter the layout names becomes a view of the version's
    array (a pointer swap under no_grad; the views are read-only memory, which inference
    never writes). Entries held in another dtype than sent, or that are not parameters
    (buffers), are copied. Returns how many parameters now view the version."""
    named = dict(model.named_parameters(remove_duplicate=False))
    pairs = list(zip(layout.entries, full.arrays, strict=True))
    fits = [e.name in named and str(named[e.name].dtype) == e.dtype
            and named[e.name].device.type == "cpu" for e, _ in pairs]
    shared = [pair for pair, ok in zip(pairs, fits, strict=True) if ok]
    copied = [pair for pair, ok in zip(pairs, fits, strict=True) if not ok]
    if copied:  # written in place: private memory first (a state_dict taken after that)
        _own(model, [e.name for e, _ in copied])
        held = model.state_dict()
        for e, arr in copied:
            held[e.name].copy_(from_raw(arr, e))
    borrowed: set[str] = getattr(model, _BORROWED, set())
    for e, arr in shared:
        named[e.name].data = from_raw(arr, e)
        if not full.mapped:
            _touch(arr)
        borrowed.add(e.name)
    setattr(model, _BORROWED, borrowed)
    return len(shared)


_PAGE = 4096


def _touch(arr: np.ndarray) -> None:
    """Map the version's pages into this process now, one read per page: a page of the object
    store this process has not mapped yet costs a minor fault on first touch (~25k for 100 MB),
    which belongs to the swap, not to the first decode step after it."""
    if arr.nbytes:
        arr.reshape(-1).view(np.uint8)[::_PAGE].max()


def own_weights(model: Any) -> int:
    """Give every parameter that views a version (borrow_full) private memory again, with the
    same values, before anything writes into the weights. Returns how many it copied."""
    borrowed: set[str] = getattr(model, _BORROWED, set())
    n = len(borrowed)
    _own(model, list(borrowed))
    return n


def _own(model: Any, names: list[str]) -> None:
    """Private memory for the named parameters that view a version (a tied parameter once,
    under all of its names)."""
    borrowed: set[str] = getattr(model, _BORROWED, set())
    want = {n for n in names if n in borrowed}
    if not want:
        return
    owned: set[int] = set()
    named = list(model.named_parameters(remove_duplicate=False))
    for name, p in named:
        if name in want and id(p) not in owned:
            p.data = p.data.clone()
            owned.add(id(p))
    for name, p in named:  # every name of a parameter that owns its memory now
        if id(p) in owned:
            borrowed.discard(name)


def _load_full(params: dict[str, torch.Tensor], layout: Layout, full: FullPacket) -> None:
    for e, arr in zip(layout.entries, full.arrays, strict=True):
        params[e.name].copy_(from_raw(arr, e))  # in place; casts if the engine's dtype differs


def _load_delta(params: dict[str, torch.Tensor], layout: Layout, delta: DeltaPacket) -> None:
    for i, pos, val in zip(delta.entries, delta.positions, delta.values, strict=True):
        p = params[layout.entries[i].name]
        if not p.is_contiguous() or str(p.dtype) != layout.entries[i].dtype:
            raise ValueError(f"cannot apply a delta to {layout.entries[i].name} "
                             f"({p.dtype}, contiguous={p.is_contiguous()}): send full versions")
        bits = p.view(-1).view(_RAW_TORCH[p.element_size()])
        bits[_np(pos).to(torch.int64)] = _np(val)


def _check(params: dict[str, torch.Tensor], layout: Layout, expected: list[int]) -> list[int]:
    """Buckets whose parameters do not match the sender's checksums (skipped for a bucket held
    in another dtype than sent: the engine cast it)."""
    if any(str(params[e.name].dtype) != e.dtype for e in layout.entries):
        return []
    got = bucket_checksums(layout, [raw(params[e.name]) for e in layout.entries])
    return [b for b, (x, y) in enumerate(zip(got, expected, strict=True)) if x != y]


def apply_packed(update: PackedUpdate, model: Any) -> None:
    """Load `update` into `model`'s parameters in place (call between batches, under the
    engine's lock); raises rather than leave a mismatched version behind when it cannot
    recover. Fills in the update's apply_s, apply_cpu_s, borrowed and fell_back."""
    t0, c0 = time.perf_counter(), time.thread_time()
    params = _params(model, update.layout)
    with torch.no_grad():
        if update.full is not None and update.full.shareable and not update.deltas:
            update.borrowed, bad = borrow_full(model, update.layout, update.full), []
        else:
            if own_weights(model):  # about to write into the weights: not into a version
                params = _params(model, update.layout)
            bad = _apply(params, update.layout, update.full, update.deltas)
        if bad and update.full is None and update.fetch_full is not None:
            log.warning("weight version %d: checksum mismatch in buckets %s after deltas; "
                        "loading the full version", update.version, bad[:5])
            full, deltas = update.fetch_full()
            update.fell_back = True
            bad = _apply(params, update.layout, full, deltas)
    update.apply_s, update.apply_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
    if bad:
        raise ChecksumMismatch(f"weight version {update.version}: buckets {bad[:5]} differ "
                               "from the sender's checksums")


def _apply(params: dict[str, torch.Tensor], layout: Layout, full: FullPacket | None,
           deltas: list[DeltaPacket]) -> list[int]:
    if full is not None:
        _load_full(params, layout, full)
    for d in deltas:
        _load_delta(params, layout, d)
    if not deltas:  # a full version alone: every element was just copied from it
        return []
    return _check(params, layout, deltas[-1].checksums)


def packed_tensors(update: PackedUpdate) -> dict[str, torch.Tensor]:
    """Zero-copy name -> tensor views of a full version (engines that load a state dict)."""
    if update.full is None or update.deltas:
        raise ValueError("this engine backend loads whole state dicts: a delta weight "
                         "version needs the torch backend (set delta = false)")
    return {e.name: from_raw(a, e) for e, a in zip(update.layout.entries, update.full.arrays,
                                                  strict=True)}


def plan_fetch(chain: dict[str, Any], have: int, inplace: bool) -> tuple[bool, list[Any]]:
    """(fetch the chain's full base?, the delta refs to fetch, in order) for a replica that
    serves version `have` (`inplace`: it can apply deltas to its own weights)."""
    deltas: list[tuple[int, Any]] = chain.get("deltas", [])
    if inplace and have in (chain["base"], *(v for v, _ in deltas)):
        return False, [ref for v, ref in deltas if v > have]
    return True, [ref for _, ref in deltas]


async def fetch_update(chain: dict[str, Any], have: int, inplace: bool,
                       slots: SlotReader | None = None) -> PackedUpdate:
    """Fetch (zero-copy on the same node) what a replica serving `have` needs of `chain`. A
    full version in a weight slot (a descriptor instead of a ref) is mapped through `slots`
    (OSError: this process cannot map it)."""
    layout = msgspec.convert(chain["layout"], Layout)
    if isinstance(chain["full"], dict):  # a weight slot: full versions only, never deltas
        reader = slots if slots is not None else SlotReader()
        # the raw bits of each entry, as `raw` gave them to the sender
        arrays, mapped = reader.arrays(
            chain["full"], [_RAW_NUMPY[dtype_bytes(e.dtype)] for e in layout.entries],
            [e.numel for e in layout.entries])
        stamp = reader.stamp(chain["full"])
        if stamp != int(chain["base"]):  # rewritten since: a bug
            raise OSError(f"weight version {chain['base']}: its slot holds version {stamp}")
        full = FullPacket(int(chain["base"]), arrays, [], shareable=True, mapped=mapped)
        return SlotUpdate(version=int(chain["version"]), layout=layout, full=full,
                          slot=chain["full"]["slot"])
    need_full, delta_refs = plan_fetch(chain, have, inplace)
    refs = ([chain["full"]] if need_full else []) + delta_refs
    got = list(await asyncio.gather(*refs))
    full = got.pop(0) if need_full else None

    def fetch_full() -> tuple[FullPacket, list[DeltaPacket]]:
        import ray

        whole = ray.get([chain["full"], *(ref for _, ref in chain["deltas"])])
        return whole[0], whole[1:]

    kind = DeltaUpdate if got or full is None else FullUpdate
    return kind(version=int(chain["version"]), layout=layout, full=full, deltas=got,
                fetch_full=fetch_full)
