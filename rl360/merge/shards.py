"""Work on one output shard: plan the output layout, read a tensor group into reused buffers,
merge it and stream the result into the shard file, or collect a statistics pass.

`collect_shard` and `merge_shard` are what a Ray task runs; the serial path calls the same
functions, which is why the two paths write byte-identical files. Per tensor they hold the
base and the N task vectors in fp32 plus O(chunk) temporaries: about (N + 2) x the largest
tensor, whatever the model size (tests/merge/test_merge_memory.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl360.merge import io, sparse
from rl360.merge.adapters import open_expert
from rl360.merge.errors import MergeError
from rl360.merge.report import Stats
from rl360.merge.strategies import Group, Method, Parts, add_partials
from rl360.merge.tensors import Entry, Pool, finish_stats, merged_pieces, tensor_stats

if TYPE_CHECKING:
    import torch

Tick = Callable[[int], None] | None


@dataclass
class Job:
    """Everything a shard worker needs (picklable, sent to Ray tasks)."""

    base: str
    experts: list[str]
    labels: list[str]
    out_dir: str
    reader: str
    threads: int
    shards: list[list[Entry]]
    bytes_per_pass: int

    def open(self) -> tuple[io.Checkpoint, list[Any]]:
        """The base and the experts (checkpoints, or adapters over the base)."""
        base = io.Checkpoint(self.base, "base", self.reader)
        experts = [
            open_expert(p, n, self.reader, self.base)
            for p, n in zip(self.experts, self.labels, strict=True)
        ]
        return base, experts


def plan(
    base: io.Checkpoint,
    experts: Sequence[io.Checkpoint],
    labels: Sequence[str],
    method: Method,
    dtype: str,
    max_shard_bytes: int,
) -> tuple[list[list[Entry]], int]:
    """Check that the experts match the base and lay the output out in shards."""
    for ck, label in zip(experts, labels, strict=True):
        if extra := [n for n in ck.infos if n not in base.infos]:
            raise MergeError(
                f"expert '{label}': tensor {extra[0]} is not in the base ({len(extra)} such)"
            )
    entries, sizes, read = [], [], 0
    for name, info in base.infos.items():
        for ck, label in zip(experts, labels, strict=True):
            other = ck.infos.get(name)
            if other is None:
                raise MergeError(f"expert '{label}': tensor {name} is missing (the base has it)")
            if other.shape != info.shape:
                raise MergeError(
                    f"tensor {name}: shape {list(other.shape)} in expert '{label}' but "
                    f"{list(info.shape)} in the base"
                )
            if other.is_float != info.is_float or (not info.is_float and other.dtype != info.dtype):
                raise MergeError(
                    f"tensor {name}: dtype {other.dtype} in expert '{label}' but {info.dtype} in the base"
                )
            read += other.nbytes
        read += info.nbytes
        if info.is_float:
            out = method.out_dtype(info.dtype) if dtype == "auto" else io.NAME_OF[dtype]
        else:
            out = info.dtype
        entries.append(Entry(name, info.shape, out, info.is_float))
        sizes.append(io.ITEMSIZE[out] * info.numel)
    shards: list[list[Entry]] = [[]]
    used = 0
    for entry, size in zip(entries, sizes, strict=True):
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(entry)
        used += size
    return shards, read


def _read32(
    ck: io.Checkpoint, entry: Entry, pool: Pool, key: str, raw_key: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor as stored, the same in fp32) read into pooled buffers."""
    import torch

    info = ck.infos[entry.name]
    if info.dtype == "F32":
        value = ck.read(entry.name, pool.bytes(key, info.nbytes))
        return value, value
    raw = ck.read(entry.name, pool.bytes(raw_key, info.nbytes))
    return raw, pool.tensor(key, entry.shape, torch.float32).copy_(raw)


def load_group(
    entry: Entry, base: io.Checkpoint, experts: Sequence[io.Checkpoint], method: Method, pool: Pool
) -> Group:
    import torch

    base_raw, base32 = _read32(base, entry, pool, "base", "raw-base")
    gates: list[torch.Tensor] | None = [] if method.uses_gates else None
    taus = []
    for i, ck in enumerate(experts):
        if gates is None and hasattr(ck, "delta"):  # an adapter: its own low-rank delta
            taus.append(ck.delta(entry.name, pool.tensor(f"tau{i}", entry.shape, torch.float32)))
            continue
        raw, tau = _read32(ck, entry, pool, f"tau{i}", "raw-expert")
        if gates is not None:
            gates.append(
                method.gate(
                    entry.name, base_raw, raw, pool.tensor(f"gate{i}", entry.shape, torch.bool)
                )
            )
        taus.append(tau.sub_(base32))
    return Group(entry.name, entry.shape, base32, taus, gates)


def copy_checked(
    entry: Entry, base: io.Checkpoint, experts: Sequence[io.Checkpoint]
) -> torch.Tensor:
    """A non-float tensor: the base's, after checking every expert has the same values."""
    import torch

    value = base.read(entry.name)
    for ck in experts:
        if not torch.equal(ck.read(entry.name), value):
            raise MergeError(
                f"tensor {entry.name}: non-float tensor differs between {ck.label} and the base "
                "(non-float tensors are copied, not merged)"
            )
    return value


def write_merged(
    writer: io.ShardWriter, entry: Entry, g: Group, parts: Parts, snap: bool, chunk: int
) -> Stats:
    """Write theta_0 + delta, part by part, in the output dtype, with its counts."""
    st = tensor_stats(entry, g.base32.numel(), len(g.taus))
    writer.write_parts(entry.name, merged_pieces(st, entry.out_dtype, g.base32, parts, snap, chunk))
    return finish_stats(entry, st)


def _threads(job: Job) -> None:
    import torch

    if torch.get_num_threads() != job.threads:
        torch.set_num_threads(job.threads)


def collect_shard(job: Job, method: Method, p: int, idx: int, tick: Tick = None) -> Any:
    """Statistics pass `p` over the float tensors of output shard `idx`."""
    _threads(job)
    base, experts = job.open()
    total = None
    pool = Pool()
    reader = ThreadPoolExecutor(1, thread_name_prefix="merge-read")
    try:
        for entry in job.shards[idx]:
            if sparse.can_load(method, job.reader, entry, base, experts):
                g = sparse.load(entry, base, experts, method, pool, reader).group
                total = add_partials(total, method.collect(p, g))
            elif entry.is_float:
                g = load_group(entry, base, experts, method, pool)
                total = add_partials(total, method.collect(p, g))
            if tick:
                tick(1)
    finally:
        reader.shutdown()
        base.close()
        for ck in experts:
            ck.close()
    return total


def merge_shard(job: Job, method: Method, idx: int, tick: Tick = None) -> Stats:
    """Merge and write output shard `idx`. A sparse-loaded tensor is written by a writer
    thread while the next one is read, compared and merged (one output buffer: only the
    scatter into it waits for the previous write)."""
    _threads(job)
    base, experts = job.open()
    entries = job.shards[idx]
    writer = io.ShardWriter(
        Path(job.out_dir) / io.shard_name(idx, len(job.shards)),
        [(e.name, e.out_dtype, e.shape) for e in entries],
    )
    stats = Stats(mass=[0.0] * len(experts))
    pool = Pool()
    slot = 0  # alternates when the output is built in the base's buffer (sparse.in_place)
    busy: list[Future[None] | None] = [None]
    reader = ThreadPoolExecutor(1, thread_name_prefix="merge-read")
    writes = ThreadPoolExecutor(1, thread_name_prefix="merge-write")

    def drain() -> None:
        for i, f in enumerate(busy):
            if f is not None:
                busy[i] = None
                f.result()

    try:
        for entry in entries:
            if sparse.can_load(method, job.reader, entry, base, experts):
                own = sparse.in_place(entry, base)
                slot = 1 - slot if own else 0
                loaded = sparse.load(entry, base, experts, method, pool, reader, slot)
                numel = loaded.base_raw.numel()
                st = tensor_stats(entry, numel, len(experts))
                drain()  # the output buffer (or the other base buffer) is free again
                out = loaded.base_raw if own else pool.tensor(
                    "out", (numel,), io.torch_dtype(entry.out_dtype))
                z = sparse.zero_delta(method, entry.name)
                sparse.output(entry, loaded, method.merge(loaded.group), z, method.snap, out, st)
                stats.add(finish_stats(entry, st))
                busy[0] = writes.submit(writer.write_parts, entry.name, [out])
            elif entry.is_float:
                g = load_group(entry, base, experts, method, pool)
                drain()
                stats.add(
                    write_merged(writer, entry, g, method.merge(g), method.snap, method.chunk)
                )
            else:
                value = copy_checked(entry, base, experts)
                drain()
                writer.write(entry.name, value)
                stats.copied += 1
            if tick:
                tick(1)
        drain()
    except BaseException:
        reader.shutdown(cancel_futures=True)
        writes.shutdown(cancel_futures=True)
        writer.abort()
        raise
    else:
        writer.close()
    finally:
        reader.shutdown()
        writes.shutdown()
        base.close()
        for ck in experts:
            ck.close()
    return stats
