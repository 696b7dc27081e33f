"""Streaming merge orchestration: plan the output, run the statistics passes and the merge
pass shard by shard, serially or as Ray tasks (one task per output shard, same function, so
the two paths write byte-identical files).

Per tensor the merge holds the base and the N task vectors in fp32 and the merged delta, so
peak memory is about (N + 2) x the largest tensor plus O(chunk) temporaries, whatever the
model size (tested in tests/merge/test_merge_memory.py).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl360.merge import io
from rl360.merge import recipe as R
from rl360.merge.errors import MergeError
from rl360.merge.report import Stats, Summary
from rl360.merge.strategies import Group, Method, Parts, add_partials, build_method

if TYPE_CHECKING:
    import torch

Tick = Callable[[int], None] | None
SUMMARY_FILE = "merge_summary.json"
TORCH_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    out_dtype: str
    is_float: bool


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

    def open(self) -> tuple[io.Checkpoint, list[io.Checkpoint]]:
        base = io.Checkpoint(self.base, "base", self.reader)
        experts = [
            io.Checkpoint(p, f"expert '{n}'", self.reader)
            for p, n in zip(self.experts, self.labels, strict=True)
        ]
        return base, experts


def _fmt(code: str, shape: tuple[int, ...]) -> str:
    return f"{code}{list(shape)}"


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


class Pool:
    """Named buffers reused from tensor to tensor: without them every tensor of the model
    would get fresh pages from the OS for its base, task vectors and reads (page faults are
    a large share of a merge's time). Each buffer grows to the largest tensor it has held."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def bytes(self, key: str, nbytes: int) -> torch.Tensor:
        import torch

        buf = self._bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            self._bufs.pop(key, None)
            buf = self._bufs[key] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]

    def tensor(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = dtype.itemsize
        for s in shape:
            n *= s
        return self.bytes(key, n).view(dtype).view(shape)


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
    """Write theta_0 + delta, part by part, in the output dtype, counting changed and
    absorbed entries (and snapping absorbed ones one step under the "snap" policy)."""

    from rl360.merge import ulp

    dtype = io.torch_dtype(entry.out_dtype)
    st = Stats(tensors=1, elements=g.base32.numel(), mass=[0.0] * len(g.taus))
    st.bf16_elements = st.elements if entry.out_dtype in ("BF16", "F16") else 0
    base = g.base32.reshape(-1)

    def pieces() -> Iterator[torch.Tensor]:
        for sl, merged in parts:
            st.mass = [a + b for a, b in zip(st.mass, merged.mass, strict=True)]
            delta = merged.delta.reshape(-1)
            for s in range(0, delta.numel(), chunk):  # an Iso part is a whole matrix
                bc, dc = base[sl][s : s + chunk], delta[s : s + chunk]
                full = bc + dc
                oc, start = full.to(dtype), bc.to(dtype)
                nz = dc != 0
                lost = nz & (oc == start)
                st.nonzero += int(nz.sum())
                st.absorbed += int(lost.sum())
                if entry.out_dtype != "BF16":
                    st.absorbed_bf16 += int((nz & (full.bfloat16() == bc.bfloat16())).sum())
                if snap and bool(lost.any()):
                    oc = ulp.snap(oc, bc, dc, lost)
                    st.snapped += int(lost.sum())
                st.changed += int((oc != start).sum())
                yield oc

    writer.write_parts(entry.name, pieces())
    if entry.out_dtype == "BF16":
        st.absorbed_bf16 = st.absorbed
    return st


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
    try:
        for entry in job.shards[idx]:
            if entry.is_float:
                g = load_group(entry, base, experts, method, pool)
                total = add_partials(total, method.collect(p, g))
            if tick:
                tick(1)
    finally:
        base.close()
        for ck in experts:
            ck.close()
    return total


def merge_shard(job: Job, method: Method, idx: int, tick: Tick = None) -> Stats:
    """Merge and write output shard `idx`."""
    _threads(job)
    base, experts = job.open()
    entries = job.shards[idx]
    writer = io.ShardWriter(
        Path(job.out_dir) / io.shard_name(idx, len(job.shards)),
        [(e.name, e.out_dtype, e.shape) for e in entries],
    )
    stats = Stats(mass=[0.0] * len(experts))
    pool = Pool()
    try:
        for entry in entries:
            if entry.is_float:
                g = load_group(entry, base, experts, method, pool)
                stats.add(
                    write_merged(writer, entry, g, method.merge(g), method.snap, method.chunk)
                )
            else:
                writer.write(entry.name, copy_checked(entry, base, experts))
                stats.copied += 1
            if tick:
                tick(1)
    except BaseException:
        writer.abort()
        raise
    else:
        writer.close()
    finally:
        base.close()
        for ck in experts:
            ck.close()
    return stats


def _ray_map(
    fn: Callable[..., Any],
    job: Job,
    method: Method,
    args: list[tuple[Any, ...]],
    bar: Any,
    reduce: Callable[[Any], None] | None = None,
) -> list[Any]:
    """Run fn(job, method, *a) as one Ray task per shard. With `reduce`, each result is handed
    to it as it completes (in any order) and not kept; otherwise results come back in order."""
    import ray

    if not ray.is_initialized():
        ray.init()
    remote = ray.remote(num_cpus=1, max_retries=0)(fn)
    job_ref, method_ref = ray.put(job), ray.put(method)
    refs = [remote.remote(job_ref, method_ref, *a) for a in args]
    where = {r: a[-1] for r, a in zip(refs, args, strict=True)}
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for r in done:
                if reduce is not None:
                    reduce(ray.get(r))
                bar.update(len(job.shards[where[r]]))
        return [] if reduce is not None else ray.get(refs)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, MergeError):
            raise MergeError(str(e.cause)) from None
        raise


def execute(job: Job, method: Method, use_ray: bool = False, progress: bool = True) -> Stats:
    """Run the method's statistics passes, then the merge pass, over every shard.

    Partial statistics are integer counts, added as each shard finishes, so the order in
    which Ray tasks complete cannot change the result.
    """
    from tqdm import tqdm

    n = sum(len(s) for s in job.shards)
    bar = tqdm(
        total=n * (method.passes + 1), unit="tensor", disable=not progress, dynamic_ncols=True
    )
    with bar:
        for p in range(method.passes):
            bar.set_description(f"{method.name} stats {p + 1}/{method.passes}")
            acc: list[Any] = [None]

            def reduce(part: Any, acc: list[Any] = acc) -> None:
                acc[0] = add_partials(acc[0], part)

            args = [(p, i) for i in range(len(job.shards))]
            if use_ray:
                _ray_map(collect_shard, job, method, args, bar, reduce)
            else:
                for a in args:
                    reduce(collect_shard(job, method, *a, tick=bar.update))
            method.finish(p, acc[0])
        bar.set_description(f"{method.name} merge")
        args = [(i,) for i in range(len(job.shards))]
        if use_ray:
            results = _ray_map(merge_shard, job, method, args, bar)
        else:
            results = [merge_shard(job, method, *a, tick=bar.update) for a in args]
    stats = Stats(mass=[0.0] * len(job.experts))
    for st in results:
        stats.add(st)
    return stats


def _prepare_out(out: Path, inputs: Sequence[Path], overwrite: bool) -> None:
    resolved = out.resolve()
    for p in inputs:
        if p.resolve() == resolved:
            raise MergeError(f"output.dir {out} is one of the input checkpoints")
    if out.exists() and not out.is_dir():
        raise MergeError(f"output.dir {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise MergeError(
                f"output.dir {out} is not empty (set output.overwrite = true to replace it)"
            )
        shutil.rmtree(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MergeError(f"output.dir {out}: cannot create it ({e.strerror or e})") from None


def merge_checkpoints(
    base: str | Path,
    experts: Sequence[R.Expert],
    method_cfg: R.MethodConfig,
    output: R.Output,
    run: R.Run | None = None,
    ray: bool | None = None,
    progress: bool | None = None,
) -> Summary:
    """Merge `experts` onto `base` with one method and write an HF checkpoint to output.dir."""
    import torch

    run = run or R.Run()
    use_ray = run.ray if ray is None else ray
    show = run.progress if progress is None else progress
    t0 = time.perf_counter()
    labels = [e.label for e in experts]
    method = build_method(method_cfg, [e.weight for e in experts], run.chunk_elements)
    base_ck = io.Checkpoint(base, "base", run.reader)
    expert_cks = [io.Checkpoint(e.path, f"expert '{e.label}'", run.reader) for e in experts]
    shards, read = plan(
        base_ck, expert_cks, labels, method, output.dtype, R.parse_size(output.max_shard_size)
    )
    out = Path(output.dir)
    _prepare_out(out, [base_ck.path, *(c.path for c in expert_cks)], output.overwrite)
    job = Job(str(base_ck.path), [str(c.path) for c in expert_cks], labels, str(out), run.reader,
              torch.get_num_threads(), shards, read)  # fmt: skip
    stats = execute(job, method, use_ray, show)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        for e in shard:
            weight_map[e.name] = io.shard_name(i, len(shards))
            total += io.ITEMSIZE[e.out_dtype] * _numel(e.shape)
    io.write_index(out, weight_map, total)
    float_dtypes = sorted({e.out_dtype for s in shards for e in s if e.is_float})
    single = TORCH_NAMES.get(float_dtypes[0]) if len(float_dtypes) == 1 else None
    io.copy_side_files(base_ck.path, out, single)
    written = sum((out / io.shard_name(i, len(shards))).stat().st_size for i in range(len(shards)))
    summary = Summary(
        method=method.name, experts=labels, out_dir=str(out), out_dtypes=float_dtypes,
        shards=len(shards), seconds=time.perf_counter() - t0, bytes_read=read * (1 + method.passes),
        bytes_written=written, stats=stats, passes=method.passes)  # fmt: skip
    (out / SUMMARY_FILE).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def run_recipe(
    recipe: R.Recipe,
    ray: bool | None = None,
    progress: bool | None = None,
    evaluator: Callable[[Path], float] | None = None,
) -> Summary:
    """Run a validated recipe (greedy soup goes through `greedy.greedy_soup`)."""
    if isinstance(recipe.method, R.GreedySoup):
        from rl360.merge.evaluators import recipe_evaluator
        from rl360.merge.greedy import greedy_soup

        score = evaluator or recipe_evaluator(recipe.method.evaluator, recipe.method.metric)
        return greedy_soup(
            recipe.base, recipe.experts, score, recipe.output, recipe.run, ray, progress
        )
    return merge_checkpoints(
        recipe.base, recipe.experts, recipe.method, recipe.output, recipe.run, ray, progress
    )
