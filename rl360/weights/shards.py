"""Sharded, bucketed weight sync: every trainer rank sends the part of the weights it holds.

An FSDP2 rank holds a dim-0 shard of every parameter (a `DTensor`); a replicated trainer rank
(the torch backend) holds everything, and the ranks split the tensors between them by size.
Each rank cuts its part, cast to the engines' dtype, into buckets of at most `bucket_bytes`
(a tensor larger than that is split across buckets at element boundaries) and broadcasts them,
one bucket at a time, over a group of its own with every engine replica
(rl360.weights.shard_groups sends and receives; rl360.weights.shard_transport forms the
groups). A rank's extra memory during a sync is one
bucket buffer: the pieces are cast straight into it. No rank ever holds the full model.

A replica receives from every rank at once (a thread per rank), checks each bucket against the
xxh3-64 checksum that follows it, and writes its pieces into staging tensors of the full shapes;
only a version whose every bucket arrived intact goes to the engine (a `TensorUpdate`, applied
like any other version: in flight on the torch engine), so nothing is ever half-applied.

The plan is metadata only: `RankPart` per rank (the full tensors' spec, tied names, that rank's
buckets of `Piece`s), `combine` checks that the ranks' pieces cover every element of every
tensor exactly once. Pure functions of shapes up to `held_parts`, which reads a rank's tensors.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import NamedTuple

import msgspec
import torch
import xxhash

from rl360.weights.payloads import dtype_bytes

ALIGN = 8  # bytes: every piece starts at a multiple of this inside its bucket
TRAILER = 8  # bytes after a bucket's payload: the xxh3-64 of the payload

Spec = list[tuple[str, list[int], str]]


class Piece(msgspec.Struct, array_like=True, frozen=True):
    """Elements [start, start + numel) of the flat full tensor `name`, at byte `offset` of its
    bucket."""

    name: str
    start: int
    numel: int
    offset: int


class Bucket(msgspec.Struct, array_like=True):
    pieces: list[Piece]
    nbytes: int  # payload bytes (a multiple of ALIGN); the checksum follows


class RankPart(msgspec.Struct):
    """What one trainer rank sends: the full tensors of a version (every rank reports the same
    spec, in the engines' dtype), tied names (alias -> the name whose data it shares) and the
    buckets of this rank's pieces."""

    rank: int
    spec: Spec
    aliases: dict[str, str]
    buckets: list[Bucket]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


class ShardPlan(msgspec.Struct):
    """Every rank's buckets (`ranks[r]`), checked to cover each tensor exactly once."""

    spec: Spec
    aliases: dict[str, str]
    ranks: list[list[Bucket]]
    bucket_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for bs in self.ranks for b in bs)

    def senders(self) -> list[int]:
        """The ranks that send anything."""
        return [r for r, bs in enumerate(self.ranks) if bs]


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def bucket_limit(bucket_mb: float) -> int:
    """A bucket's payload bytes for `bucket_mb` (a multiple of ALIGN, at least one ALIGN)."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    return max(ALIGN, int(bucket_mb * 1024 * 1024) // ALIGN * ALIGN)


# ----------------------------------------------------------------------------- a rank's part


class Held(NamedTuple):
    """Elements [start, start + flat.numel()) of the full tensor `name` (engine dtype `dtype`),
    as this rank holds them (`flat`: a flat view in the trainer's dtype)."""

    name: str
    shape: list[int]
    dtype: str
    start: int
    flat: torch.Tensor


def _engine_dtype(t: torch.Tensor, dtype: str | None) -> str:
    if dtype and t.is_floating_point():
        return str(getattr(torch, dtype.removeprefix("torch.")))
    return str(t.dtype)


def held_parts(state: Mapping[str, torch.Tensor], rank: int, world: int,
               dtype: str | None = None) -> tuple[Spec, dict[str, str], list[Held]]:
    """(the spec of the full tensors, tied names, what this rank sends of them) for a rank's
    `state` (name -> tensor or DTensor, e.g. `model.state_dict(keep_vars=True)`).

    A DTensor sharded on dim 0 (FSDP2) or replicated over a 1-D mesh is sent by the rank that
    holds each row (a replicated one by mesh rank 0). Plain tensors are held whole by every
    rank: they are split between the `world` ranks by size (each tensor to the rank with the
    fewest bytes so far, in order), the same split on every rank."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    spec: Spec = []
    aliases: dict[str, str] = {}
    held: list[Held] = []
    first: dict[int, str] = {}
    load = [0] * max(1, world)
    for name, t in state.items():
        if id(t) in first:  # tied weights: one tensor under two names
            aliases[name] = first[id(t)]
            continue
        first[id(t)] = name
        shape, out = list(t.shape), _engine_dtype(t, dtype)
        spec.append((name, shape, out))
        if isinstance(t, DTensor):
            mesh, places = t.device_mesh, t.placements
            if mesh.ndim != 1 or not all((isinstance(p, Shard) and p.dim == 0)
                                         or isinstance(p, Replicate) for p in places):
                raise ValueError(f"sharded weight sync: {name} is placed {places} on a "
                                 f"{mesh.ndim}-D mesh; only dim-0 shards (FSDP2) or "
                                 "replicas over a 1-D mesh are supported")
            local = t.detach().to_local()
            if isinstance(places[0], Replicate):
                if mesh.get_local_rank() != 0 or not local.numel():
                    continue
                held.append(Held(name, shape, out, 0, local.reshape(-1)))
                continue
            local_shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, places)
            if not _numel(list(local_shape)):
                continue
            if not local.is_contiguous():
                raise ValueError(f"sharded weight sync: {name}'s local shard is not contiguous")
            row = _numel(shape[1:])
            held.append(Held(name, shape, out, int(offset[0]) * row, local.reshape(-1)))
            continue
        owner = min(range(len(load)), key=lambda r: (load[r], r))
        load[owner] += t.numel() * dtype_bytes(out)
        if owner == rank and t.numel():
            held.append(Held(name, shape, out, 0, t.detach().contiguous().reshape(-1)))
    return spec, aliases, held


def cut_buckets(held: list[Held], limit: int) -> list[Bucket]:
    """This rank's pieces in buckets of at most `limit` payload bytes (bucket_limit), a tensor
    split at element boundaries where it does not fit."""
    buckets: list[Bucket] = []
    pieces: list[Piece] = []
    off = 0
    for h in held:
        size = dtype_bytes(h.dtype)
        if size > limit:
            raise ValueError(f"bucket of {limit} bytes cannot hold one element of {h.name}")
        done, n = 0, h.flat.numel()
        while done < n:
            off = _align(off)
            room = (limit - off) // size
            if room <= 0:
                buckets.append(Bucket(pieces, _align(off)))
                pieces, off = [], 0
                continue
            k = min(room, n - done)
            pieces.append(Piece(h.name, h.start + done, k, off))
            off += k * size
            done += k
    if pieces:
        buckets.append(Bucket(pieces, _align(off)))
    return buckets


def rank_part(state: Mapping[str, torch.Tensor], rank: int, world: int, dtype: str | None,
              limit: int) -> tuple[RankPart, list[Held]]:
    spec, aliases, held = held_parts(state, rank, world, dtype)
    return RankPart(rank, spec, aliases, cut_buckets(held, limit)), held


def combine(parts: list[RankPart], limit: int) -> ShardPlan:
    """The plan of every rank's part (in rank order), checked: the same spec on every rank and
    every element of every tensor sent exactly once."""
    if not parts:
        raise ValueError("sharded weight sync: no trainer ranks")
    spec, aliases = parts[0].spec, parts[0].aliases
    for p in parts[1:]:
        if p.spec != spec or p.aliases != aliases:
            raise ValueError(f"sharded weight sync: trainer rank {p.rank} holds other tensors "
                             "than rank 0")
    shapes = {n: s for n, s, _ in spec}
    spans: dict[str, list[tuple[int, int]]] = {n: [] for n in shapes}
    for p in parts:
        for b in p.buckets:
            if b.nbytes > limit:
                raise ValueError(f"rank {p.rank}: a bucket of {b.nbytes} bytes > {limit}")
            for piece in b.pieces:
                if piece.name not in spans:
                    raise ValueError(f"rank {p.rank} sends {piece.name!r}, not in the spec")
                spans[piece.name].append((piece.start, piece.start + piece.numel))
    for name, got in spans.items():
        at = 0
        for a, b in sorted(got):
            if a != at:
                raise ValueError(f"sharded weight sync: {name} elements {min(a, at)}.."
                                 f"{max(a, at)} are sent {'twice' if a < at else 'by no rank'}")
            at = b
        if at != _numel(shapes[name]):
            raise ValueError(f"sharded weight sync: {name} elements {at}.. are sent by no rank")
    return ShardPlan(spec, dict(aliases), [p.buckets for p in parts], limit)


# ----------------------------------------------------------------------------- checksums


def _bits(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().cpu().contiguous().numpy()).cast("B")


def bucket_checksum(payload: torch.Tensor) -> int:
    """xxh3-64 of a bucket's payload bytes (a uint8 tensor)."""
    return int(xxhash.xxh3_64_intdigest(_bits(payload)))


def left(deadline: float) -> float:
    """Seconds to `deadline` (perf_counter), at least a little: a timeout for one broadcast."""
    return max(0.05, deadline - time.perf_counter())


def signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def full_checksums(parts: list[dict[str, tuple[int, int, int]]],
                   aliases: Mapping[str, str]) -> dict[str, int]:
    """`tensor_checksum` of every full tensor (and its tied names) from every rank's parts."""
    from rl360.weights.plan import finish_checksum

    sums: dict[str, list[int]] = {}
    for part in parts:
        for name, (total, words, width) in part.items():
            acc = sums.setdefault(name, [0, 0, width])
            acc[0], acc[1] = acc[0] + total, acc[1] + words
    out = {n: finish_checksum(t % ((1 << 61) - 1), w, width)
           for n, (t, w, width) in sums.items()}
    for alias, name in aliases.items():
        out[alias] = out[name]
    return out
