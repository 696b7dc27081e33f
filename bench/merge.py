"""Merge throughput: RAM and TIES over a synthetic multi-shard bf16 model, against reading
the same safetensors files without merging.

    .venv/bin/python bench/merge.py [--size-mb 512] [--experts 2] [--keep DIR]

A child process writes a base (default 512 MB of bf16, 16 tensors in 4 shards) and experts
that each moved a sparse 5% of the weights by 1-3 bf16 steps (RL-like), into a temp dir.
This process then times (1) the baseline: `safetensors.safe_open(...).get_tensor` of every
tensor of every checkpoint; (2) `rl360.merge` with RAM (fp32 output, one pass) and with TIES
(paper scope: 3 statistics passes + the merge, bf16 output). MB/s is input checkpoint bytes
over wall time, files warm in the page cache for every run. Peak RSS growth of each run is
measured with VmHWM. The last line is one JSON object:
{"bench": "merge", "ours": <RAM MB/s>, "baseline": <read-only MB/s>, "ratio": ours/baseline, ...}
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS, SHARDS = 16, 4


def generate(root: Path, size_mb: int, experts: int) -> None:
    """Write base + experts as sharded checkpoints (run in a child process): each base tensor
    is drawn once and every expert moves a random 5% of it by 1-3 bf16 steps either way."""
    import torch

    from rl360.merge import io, ulp

    cols = 4096
    rows = max(1, size_mb * 2**20 // 2 // LAYERS // cols)
    names = [f"model.layers.{i}.mlp.weight" for i in range(LAYERS)]
    per = LAYERS // SHARDS
    who = ["base", *(f"expert{e}" for e in range(experts))]
    for w in who:
        (root / w).mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for s in range(SHARDS):
        part = names[s * per : (s + 1) * per]
        file = io.shard_name(s, SHARDS)
        writers = [
            io.ShardWriter(root / w / file, [(n, "BF16", (rows, cols)) for n in part]) for w in who
        ]
        for n in part:
            base = (torch.randn(rows, cols, generator=gen) * 0.02).bfloat16()
            writers[0].write(n, base)
            o = ulp.ordinal(base)
            for writer in writers[1:]:
                r = torch.randint(0, 120, (rows, cols), generator=gen, dtype=torch.int32)
                step = torch.where(r < 6, r - 3 + (r >= 3).int(), 0)  # -3..-1, 1..3 on 5%
                writer.write(n, ulp.from_ordinal(o + step, torch.bfloat16))
        for writer in writers:
            writer.close()
    for w in who:
        io.write_index(root / w, {n: io.shard_name(i // per, SHARDS) for i, n in enumerate(names)},
                       LAYERS * rows * cols * 2)  # fmt: skip
        (root / w / "config.json").write_text(
            json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"})
        )


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


class Peak:
    """Peak RSS growth over a block (VmHWM, reset through /proc/self/clear_refs)."""

    def __enter__(self) -> Peak:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass
        self.before = _status("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.growth = max(0, _status("VmHWM") - self.before)


def read_all(paths: list[Path]) -> None:
    from safetensors import safe_open

    for p in paths:
        for f in sorted(p.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    h.get_tensor(k).clone()  # get_tensor may map the file lazily: copy it in


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=512, help="base checkpoint size")
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="use/keep the synthetic model in this dir")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: the read-only "
        "baseline is single-threaded too, and a shared 2-core box spins on more)",
    )
    ap.add_argument("--generate", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate:
        generate(args.generate, args.size_mb, args.experts)
        return

    import torch

    from rl360.merge import io
    from rl360.merge import recipe as R
    from rl360.merge.runner import merge_checkpoints

    torch.set_num_threads(args.threads)

    tmp = Path(tempfile.mkdtemp(prefix="rl360-bench-merge-"))
    root = args.keep or tmp / "model"
    try:
        if not (root / "base").is_dir():
            t = time.perf_counter()
            cmd = [sys.executable, __file__, "--generate", str(root), "--size-mb", str(args.size_mb),
                   "--experts", str(args.experts)]  # fmt: skip
            subprocess.run(cmd, check=True)
            print(f"generated base + {args.experts} experts in {time.perf_counter() - t:.1f}s")
        inputs = [root / "base", *(root / f"expert{e}" for e in range(args.experts))]
        total = sum(f.stat().st_size for p in inputs for f in p.glob("*.safetensors"))
        ck = io.Checkpoint(inputs[0])
        largest = max(i.nbytes for i in ck.infos.values())
        print(
            f"input: {len(inputs)} checkpoints x {SHARDS} shards, {total / 1e6:.0f} MB; "
            f"largest tensor {largest / 1e6:.0f} MB bf16 ({2 * largest / 1e6:.0f} MB in fp32)"
        )
        print(f"torch threads: {torch.get_num_threads()}")
        read_all(inputs)  # warm the page cache
        with Peak() as p_read:
            t = time.perf_counter()
            read_all(inputs)
            base_s = time.perf_counter() - t
        baseline = total / 1e6 / base_s
        print(
            f"baseline (safe_open read only): {baseline:.0f} MB/s, peak RSS +{p_read.growth / 1e6:.0f} MB"
        )
        experts = [R.Expert(path=str(p)) for p in inputs[1:]]
        results = {}
        for name, cfg in (("ram", R.Ram()), ("ties", R.Ties())):
            out = R.Output(dir=str(tmp / f"out-{name}"), max_shard_size="200MB")
            with Peak() as peak:
                t = time.perf_counter()
                s = merge_checkpoints(inputs[0], experts, cfg, out, R.Run(progress=False))
                secs = time.perf_counter() - t
            results[name] = (total / 1e6 / secs, peak.growth, s)
            print(
                f"{name}: {total / 1e6 / secs:.0f} MB/s ({secs:.1f}s, {1 + s.passes} pass(es), "
                f"{s.bytes_written / 1e6:.0f} MB written as {'/'.join(s.out_dtypes)}, "
                f"{100 * s.stats.changed / s.stats.elements:.1f}% of elements changed), "
                f"ratio {total / 1e6 / secs / baseline:.3f}, peak RSS +{peak.growth / 1e6:.0f} MB "
                f"= {peak.growth / (2 * largest):.1f} x largest fp32 tensor"
            )
            shutil.rmtree(out.dir)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(f"peak RSS of this process: {rss / 1e6:.0f} MB")
        ours = results["ram"][0]
        print(json.dumps({
            "bench": "merge", "ours": round(ours, 1), "baseline": round(baseline, 1),
            "ratio": round(ours / baseline, 3), "method": "ram", "threads": args.threads,
            "ties_mb_s": round(results["ties"][0], 1), "ties_ratio": round(results["ties"][0] / baseline, 3),
            "input_mb": round(total / 1e6), "largest_tensor_mb": round(largest / 1e6),
            "peak_rss_mb": round(rss / 1e6),
            "peak_rss_growth_mb": {k: round(v[1] / 1e6) for k, v in results.items()},
        }))  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
