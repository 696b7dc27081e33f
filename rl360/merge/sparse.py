"""Sparse, pipelined tensor loading and writing for elementwise methods.

RL experts leave most entries bit-identical to the base (5-30% change; one bf16 step each),
and every elementwise method (`Method.sparse`) merges all-zero task vectors to a zero delta.
So per tensor the loader reads the base and the experts in large chunks (a reader thread
preads chunk j + 1 while chunk j is compared), keeps the positions where some expert's bits
differ from the base's, and hands the method a `Group` of only those entries (fp32, gathered;
`zeros` counts the rest). The output tensor is the base's values in the output dtype with the
merged entries scattered in, handed whole to a writer thread: one large sequential write per
tensor, overlapped with the next tensor's reads and compute.

The bytes are those of the dense path: at an untouched position the dense path writes
cast(theta_0 + z), z being the method's delta for all-zero task vectors (+0 or -0), which is
the base's value, -0 turned into +0 when z is +0 (the base's -0 positions are found chunk by
chunk while the chunk is in cache); the merged entries get the same per-element arithmetic.
When the output dtype is the base's, the output is built in the base's own buffer (no copy;
merge_shard alternates two of them so the writer thread may still hold the other). Memory per tensor: the base as stored, the output, two chunks per expert and the
gathered entries (4 bytes x (N + 1) each), below the dense path's (N + 2) fp32 copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rl360.merge import io
from rl360.merge.report import Stats
from rl360.merge.strategies import Group, Method, Parts
from rl360.merge.tensors import Entry, Pool, merged_pieces

if TYPE_CHECKING:
    import torch

BITS = {2: np.uint16, 4: np.uint32}  # compare float bit patterns as unsigned ints
SIGN = {2: 0x8000, 4: 0x80000000}  # the pattern of -0
IO_BYTES = 1 << 20  # per checkpoint and read: large preads, a small footprint


def can_load(method: Method, reader: str, entry: Entry, base: io.Checkpoint,
             experts: Sequence[io.Checkpoint]) -> bool:  # fmt: skip
    """The sparse path applies: an elementwise method, pread I/O, and base and experts stored
    in one 16- or 32-bit float dtype (bitwise equality is then value equality, up to +-0)."""
    if not (method.sparse and reader == "pread" and entry.is_float):
        return False
    if any(hasattr(ck, "delta") for ck in experts):  # an adapter: nothing stored to compare
        return False
    info = base.infos[entry.name]
    return io.ITEMSIZE[info.dtype] in BITS and all(
        ck.infos[entry.name].dtype == info.dtype for ck in experts
    )


@dataclass
class Loaded:
    group: Group  # the changed entries only (1-D, gathered)
    idx: torch.Tensor  # their flat positions (int64, ascending)
    base_raw: torch.Tensor  # the whole base tensor as stored (flat, pooled)
    neg: np.ndarray  # flat positions where the base holds -0 (found chunk by chunk)


def in_place(entry: Entry, base: io.Checkpoint) -> bool:
    """The output tensor is the base's dtype: `output` then works in the base's buffer (no
    copy), so merge_shard alternates two pooled base buffers (one may still be written)."""
    return base.infos[entry.name].dtype == entry.out_dtype


def load(entry: Entry, base: io.Checkpoint, experts: Sequence[io.Checkpoint], method: Method,
         pool: Pool, reader: ThreadPoolExecutor, slot: int = 0) -> Loaded:  # fmt: skip
    """Read one tensor of the base and every expert, keeping the entries some expert changed
    (the base goes whole into pooled buffer `slot`)."""
    import torch

    info = base.infos[entry.name]
    size = io.ITEMSIZE[info.dtype]
    bits = BITS[size]
    numel = info.numel
    dtype = io.torch_dtype(info.dtype)
    base_raw = pool.bytes(f"base-raw{slot or ''}", info.nbytes)
    base_np = base_raw.numpy().view(bits)
    step = max(IO_BYTES // size, method.chunk)
    bufs = [[pool.bytes(f"chunk{s}-{i}", step * size).numpy().view(bits)
             for i in range(len(experts))] for s in (0, 1)]  # fmt: skip
    diff = pool.bytes("diff", step).numpy().view(np.bool_)
    tmp = pool.bytes("diff-tmp", step).numpy().view(np.bool_)

    def fetch(s: int, start: int) -> None:
        n = min(step, numel - start)
        base.read_bytes(entry.name, start * size, base_np[start : start + n])
        for ck, buf in zip(experts, bufs[s], strict=True):
            ck.read_bytes(entry.name, start * size, buf[:n])

    idx_parts, base_parts, neg_parts = [], [], []
    exp_parts: list[list[np.ndarray]] = [[] for _ in experts]
    starts = list(range(0, numel, step))
    pending: Future[None] | None = reader.submit(fetch, 0, 0) if starts else None
    for j, start in enumerate(starts):
        assert pending is not None
        pending.result()
        if j + 1 < len(starts):
            pending = reader.submit(fetch, (j + 1) % 2, starts[j + 1])
        n = min(step, numel - start)
        b, d, t = base_np[start : start + n], diff[:n], tmp[:n]
        for e, buf in enumerate(bufs[j % 2]):
            np.not_equal(buf[:n], b, out=d if e == 0 else t)
            if e:
                np.logical_or(d, t, out=d)
        np.equal(b, SIGN[size], out=t)  # -0 in the base, while the chunk is in cache
        if t.any():
            neg_parts.append(np.flatnonzero(t) + start)
        where = np.flatnonzero(d)
        idx_parts.append(where + start)
        base_parts.append(b[where])
        for parts, buf in zip(exp_parts, bufs[j % 2], strict=True):
            parts.append(buf[:n][where])
    idx = torch.from_numpy(np.concatenate(idx_parts) if idx_parts else np.zeros(0, np.int64))
    m = idx.numel()

    def gathered(parts: list[np.ndarray]) -> torch.Tensor:
        arr = np.concatenate(parts) if parts else np.zeros(0, bits)
        return torch.from_numpy(arr).view(dtype)

    b_raw = gathered(base_parts)
    base32 = b_raw.float()
    taus, gates = [], [] if method.uses_gates else None
    for parts in exp_parts:
        e_raw = gathered(parts)
        if gates is not None:
            gates.append(method.gate(entry.name, b_raw, e_raw, torch.empty(m, dtype=torch.bool)))
        taus.append(e_raw.float().sub_(base32))
    group = Group(entry.name, (m,), base32, taus, gates, zeros=numel - m)
    neg = np.concatenate(neg_parts) if neg_parts else np.zeros(0, np.int64)
    return Loaded(group, idx, base_raw.view(dtype), neg)


def zero_delta(method: Method, name: str) -> float:
    """The method's merged delta where every task vector is 0 (+0.0 or -0.0)."""
    import torch

    z = torch.zeros(1)
    gates = [torch.zeros(1, dtype=torch.bool)] * method.n if method.uses_gates else None
    g = Group(name, (1,), z, [z] * method.n, gates)
    return float(next(iter(method.merge(g)))[1].delta[0])


def output(entry: Entry, loaded: Loaded, parts: Parts, z: float, snap: bool,
           out: torch.Tensor, stats: Stats) -> torch.Tensor:  # fmt: skip
    """The whole output tensor (flat, in `out`, which may be `loaded.base_raw` itself): the
    base's values, -0 made +0 when z is +0, with theta_0 + delta of the merged entries
    scattered in; counts go to `stats`."""
    import torch

    if out.data_ptr() != loaded.base_raw.data_ptr():
        out.copy_(loaded.base_raw)
    size = out.element_size()
    if math.copysign(1.0, z) > 0:
        ints = out.view(torch.int16 if size == 2 else torch.int32).numpy().view(BITS[size])
        # the dense path writes cast(theta_0 + 0.0): +0 exactly where theta_0 is -0 (a tiny
        # negative theta_0 that the cast rounds to -0 stays -0)
        ints[loaded.neg] = 0
    g = loaded.group
    pieces = list(merged_pieces(stats, entry.out_dtype, g.base32, parts, snap, 1 << 62))
    if pieces:
        out.index_copy_(0, loaded.idx, torch.cat(pieces) if len(pieces) > 1 else pieces[0])
    return out
