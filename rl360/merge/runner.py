"""Merge orchestration: check and plan the output, run the method's statistics passes and
the merge pass shard by shard, serially or as Ray tasks (one task per output shard, running
the same `shards` functions, so both paths write byte-identical files), then write the
index, the base's config and tokenizer files and the summary.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rl360.merge import io
from rl360.merge import recipe as R
from rl360.merge.adapters import open_expert
from rl360.merge.errors import MergeError
from rl360.merge.report import Stats, Summary
from rl360.merge.shards import Job, collect_shard, merge_shard, plan
from rl360.merge.strategies import Method, add_partials, build_method
from rl360.ray_session import ray_session

SUMMARY_FILE = "merge_summary.json"
TORCH_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


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
        p = 0
        while p < method.passes:  # a method may decide after a pass that it needs another
            bar.total = n * (method.passes + 1)
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
            p += 1
        while True:
            bar.set_description(f"{method.name} merge")
            args = [(i,) for i in range(len(job.shards))]
            if use_ray:
                results = _ray_map(merge_shard, job, method, args, bar)
            else:
                results = [merge_shard(job, method, *a, tick=bar.update) for a in args]
            stats = Stats(mass=[0.0] * len(job.experts))
            for st in results:
                stats.add(st)
            if not method.rerun(stats.method_counts):
                return stats
            method.passes += 1  # counted in the summary's passes and bytes read
            bar.total += n


def _execute_with_ray(job: Job, method: Method, progress: bool) -> Stats:
    """Use the connected Ray cluster, else the project's: RAY_ADDRESS, or a new local one."""
    import ray

    if ray.is_initialized():
        return execute(job, method, True, progress)

    with ray_session(dashboard=False, namespace="rl360-merge"):
        return execute(job, method, True, progress)


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
    expert_cks = [open_expert(e.path, e.label, run.reader, base_ck.path) for e in experts]
    shards, read = plan(
        base_ck, expert_cks, labels, method, output.dtype, R.parse_size(output.max_shard_size)
    )
    out = Path(output.dir)
    _prepare_out(out, [base_ck.path, *(c.path for c in expert_cks)], output.overwrite)
    job = Job(str(base_ck.path), [str(c.path) for c in expert_cks], labels, str(out), run.reader,
              torch.get_num_threads(), shards, read)  # fmt: skip
    stats = _execute_with_ray(job, method, show) if use_ray else execute(job, method, False, show)
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
