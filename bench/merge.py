"""Merge throughput: RAM, task arithmetic and TIES over a synthetic Llama-layout bf16 model,
against reading the same safetensors files without merging; optionally against mergekit.

    .venv/bin/python bench/merge.py [--size-mb 512] [--experts 2] [--keep DIR] [--runs 3]
    .venv/bin/python bench/merge.py --vs-mergekit [--mergekit .venv-mergekit/bin/mergekit-yaml]

A child process writes a base (default 512 MB of bf16 in a LlamaForCausalLM layout, 4 shards)
and experts that each moved a sparse 5% of the weights by 1-3 bf16 steps (RL-like), into a
temp dir. Each of `--runs` rounds times (1) the baseline: `safetensors.safe_open(...)
.get_tensor` of every tensor of every checkpoint; (2) `rl360.merge` with RAM (fp32 output,
one pass), task arithmetic (bf16 output) and TIES (paper scope: 3 statistics passes + the
merge, bf16 output). MB/s is input checkpoint bytes over wall time, files warm in the page
cache; a ratio is ours over the baseline of the same round, by wall time and by CPU time (user
+ system of all threads, which a loaded shared box disturbs less); (3) after each merge, its
I/O floor: every input file read once and the method's output bytes written once, the cheapest
way (`io_floor`), and the floor's time over the merge's; figures are the median and the spread
(min-max) of the rounds. With --vs-mergekit, mergekit (0.1.5, run as an external
program from its own venv: `make bench-mergekit`) does linear / task_arithmetic / ties / ram
on the same checkpoints (fp32 compute, fp32 output on both sides so rounding to bf16 cannot
hide a difference) and the bench prints both wall times and the max abs difference of the
outputs. The last line is one JSON object:
{"bench": "merge", "ours": <RAM MB/s>, "baseline": <read-only MB/s>, "ratio": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARDS = 4
HIDDEN, INTER, VOCAB = 1024, 2816, 16384


def layout(size_mb: int) -> tuple[int, list[tuple[str, tuple[int, ...]]]]:
    """(layers, [(name, shape)]) of a Llama model of about size_mb MB in bf16."""
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN
    layers = max(1, (size_mb * 2**20 // 2 - 2 * VOCAB * HIDDEN) // per_layer)
    names = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [(p + f"self_attn.{x}_proj.weight", (HIDDEN, HIDDEN)) for x in "qkvo"]
        names += [(p + "mlp.gate_proj.weight", (INTER, HIDDEN)),
                  (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
                  (p + "mlp.down_proj.weight", (HIDDEN, INTER)),
                  (p + "input_layernorm.weight", (HIDDEN,)),
                  (p + "post_attention_layernorm.weight", (HIDDEN,))]  # fmt: skip
    names += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return layers, names


def generate(root: Path, size_mb: int, experts: int) -> None:
    """Write base + experts as sharded checkpoints (run in a child process): each base tensor
    is drawn once and every expert moves a random 5% of it by 1-3 bf16 steps either way."""
    import torch

    from rl360.merge import io, ulp

    layers, names = layout(size_mb)
    sizes = [2 * (shape[0] * (shape[1] if len(shape) > 1 else 1)) for _, shape in names]
    per = sum(sizes) / SHARDS
    shard_of, acc = [], 0
    for size in sizes:
        shard_of.append(min(SHARDS - 1, int(acc // per)))
        acc += size
    who = ["base", *(f"expert{e}" for e in range(experts))]
    for w in who:
        (root / w).mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for s in range(SHARDS):
        part = [nm for nm, sh in zip(names, shard_of, strict=True) if sh == s]
        file = io.shard_name(s, SHARDS)
        writers = [io.ShardWriter(root / w / file, [(n, "BF16", shape) for n, shape in part])
                   for w in who]  # fmt: skip
        for n, shape in part:
            if len(shape) == 1:
                base = (1 + torch.randn(shape, generator=gen) * 0.05).bfloat16()
            else:
                base = (torch.randn(shape, generator=gen) * 0.02).bfloat16()
            writers[0].write(n, base)
            o = ulp.ordinal(base)
            for writer in writers[1:]:
                r = torch.randint(0, 120, shape, generator=gen, dtype=torch.int32)
                step = torch.where(r < 6, r - 3 + (r >= 3).int(), 0)  # -3..-1, 1..3 on 5%
                writer.write(n, ulp.from_ordinal(o + step, torch.bfloat16))
        for writer in writers:
            writer.close()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": layers,
              "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": VOCAB,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}  # fmt: skip
    for w in who:
        weight_map = {
            n: io.shard_name(s, SHARDS) for (n, _), s in zip(names, shard_of, strict=True)
        }
        io.write_index(root / w, weight_map, sum(sizes))
        (root / w / "config.json").write_text(json.dumps(config, indent=2))


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


def io_floor(inputs: list[Path], out_bytes: int, scratch: Path) -> float:
    """Seconds to read every input file once and write `out_bytes` once: the I/O a merge cannot
    avoid, done the cheapest way (8 MB unbuffered reads into one buffer, 8 MB writes to the page
    cache, the file removed after)."""
    buf = memoryview(bytearray(8 << 20))
    t = time.perf_counter()
    for p in inputs:
        for f in sorted(p.glob("*.safetensors")):
            with open(f, "rb", buffering=0) as h:
                while h.readinto(buf):
                    pass
    with open(scratch, "wb", buffering=0) as w:
        left = out_bytes
        while left > 0:
            left -= w.write(buf[: min(left, len(buf))])
    secs = time.perf_counter() - t
    scratch.unlink()
    return secs


def cpu_s(who: int = resource.RUSAGE_SELF) -> float:
    """CPU seconds (user + system, all threads) used so far: on a shared box this moves far
    less with the load than wall time does."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})"


def timed_merge(
    inputs: list[Path], cfg: object, out: Path, dtype: str = "auto"
) -> tuple[float, float, int]:
    from rl360.merge import recipe as R
    from rl360.merge.runner import merge_checkpoints

    experts = [R.Expert(path=str(p)) for p in inputs[1:]]
    output = R.Output(dir=str(out), max_shard_size="200MB", dtype=dtype, overwrite=True)
    with Peak() as peak:
        t, c = time.perf_counter(), cpu_s()
        merge_checkpoints(inputs[0], experts, cfg, output, R.Run(progress=False))
        secs, cpu = time.perf_counter() - t, cpu_s() - c
    return secs, cpu, peak.growth


# mergekit method -> (its YAML method and per-model parameters, our equivalent recipe table)
MERGEKIT = {
    "linear": ("linear", {"weight": 1.0}, "soup"),
    "task_arithmetic": ("task_arithmetic", {"weight": 1.0}, "task_arithmetic"),
    "ties": ("ties", {"weight": 1.0, "density": 0.2}, "ties"),
    "ram": ("ram", {"weight": 1.0}, "ram"),
}


def ours_like_mergekit(name: str) -> object:
    """Our method configured to mergekit's definition of `name`."""
    from rl360.merge import recipe as R

    if name == "linear":
        return R.Soup()  # mean of the experts = base + mean task vector
    if name == "task_arithmetic":
        return R.TaskArithmetic()
    if name == "ties":
        return R.Ties(density=0.2, scope="tensor")  # mergekit trims per tensor
    return R.Ram()


def mergekit_yaml(name: str, inputs: list[Path]) -> str:
    method, params, _ = MERGEKIT[name]
    lines = [f"merge_method: {method}", "dtype: float32", "out_dtype: float32"]
    if name != "linear":
        lines.append(f"base_model: {inputs[0]}")
    lines.append("models:")
    for p in inputs[1:]:
        lines += [f"  - model: {p}", f"    parameters: {json.dumps(params)}"]
    return "\n".join(lines) + "\n"


def max_abs_diff(a: Path, b: Path) -> float:
    from safetensors import safe_open

    tensors = {}
    for f in sorted(b.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                tensors[k] = (f, k)
    worst = 0.0
    for f in sorted(a.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                fb, _ = tensors.pop(k)
                with safe_open(str(fb), framework="pt") as hb:
                    x, y = h.get_tensor(k).float(), hb.get_tensor(k).float()
                worst = max(worst, float((x - y).abs().max()))
    if tensors:
        raise SystemExit(f"mergekit output lacks {sorted(tensors)[0]}")
    return worst


def vs_mergekit(exe: Path, inputs: list[Path], tmp: Path, runs: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    rows = {}
    for name in MERGEKIT:
        cfg_path = tmp / f"mergekit-{name}.yml"
        cfg_path.write_text(mergekit_yaml(name, inputs))
        mk_out, our_out = tmp / f"mk-{name}", tmp / f"ours-{name}"
        mk_s, our_s, mk_cpu, our_cpu = [], [], [], []
        for _ in range(runs):
            shutil.rmtree(mk_out, ignore_errors=True)
            cmd = [str(exe), str(cfg_path), str(mk_out), "--quiet", "--no-copy-tokenizer",
                   "--no-write-model-card", "--out-shard-size", "100M"]  # fmt: skip
            t, c = time.perf_counter(), cpu_s(resource.RUSAGE_CHILDREN)
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
            mk_s.append(time.perf_counter() - t)
            mk_cpu.append(cpu_s(resource.RUSAGE_CHILDREN) - c)
            if proc.returncode != 0:
                raise SystemExit(f"mergekit {name} failed:\n{proc.stderr[-3000:]}")
            secs, cpu, _ = timed_merge(inputs, ours_like_mergekit(name), our_out, "float32")
            our_s.append(secs)
            our_cpu.append(cpu)
        diff = max_abs_diff(our_out, mk_out)
        rows[name] = {"ours_s": round(statistics.median(our_s), 2),
                      "mergekit_s": round(statistics.median(mk_s), 2),
                      "speedup": round(statistics.median(mk_s) / statistics.median(our_s), 2),
            "ours_cpu_s": round(statistics.median(our_cpu), 2),
            "mergekit_cpu_s": round(statistics.median(mk_cpu), 2),
                      "max_abs_diff": diff}  # fmt: skip
        print(f"vs mergekit {name}: ours {statistics.median(our_s):.2f}s "
              f"({min(our_s):.2f}-{max(our_s):.2f}), mergekit {statistics.median(mk_s):.2f}s "
              f"({min(mk_s):.2f}-{max(mk_s):.2f}), speedup x{rows[name]['speedup']}; CPU "
              f"{statistics.median(our_cpu):.1f} vs {statistics.median(mk_cpu):.1f} s, "
              f"max |ours - mergekit| = {diff:.3g}")  # fmt: skip
        shutil.rmtree(mk_out, ignore_errors=True)
        shutil.rmtree(our_out, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=512, help="base checkpoint size")
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="use/keep the synthetic model in this dir")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: the read-only "
        "baseline is single-threaded too, and a shared 2-core box spins on more)",
    )
    ap.add_argument("--vs-mergekit", action="store_true", help="also run mergekit (side venv)")
    ap.add_argument("--mergekit", type=Path,
                    default=Path(__file__).resolve().parent.parent / ".venv-mergekit/bin/mergekit-yaml")  # fmt: skip
    ap.add_argument("--generate", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate:
        generate(args.generate, args.size_mb, args.experts)
        return

    import torch

    from rl360.merge import io
    from rl360.merge import recipe as R

    torch.set_num_threads(args.threads)
    args.mergekit = args.mergekit.resolve()  # mergekit runs with the temp dir as its cwd
    if args.vs_mergekit and not args.mergekit.is_file():
        raise SystemExit(f"--vs-mergekit: {args.mergekit} not found (make bench-mergekit)")

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
            f"workload: base + {args.experts} experts, LlamaForCausalLM layout, {len(ck.infos)} "
            f"bf16 tensors in {SHARDS} shards each, {total / 1e6:.0f} MB read per pass; each "
            f"expert moved 5% of the entries by 1-3 bf16 steps; largest tensor "
            f"{largest / 1e6:.0f} MB; {args.runs} runs; torch threads {torch.get_num_threads()}"
        )
        print(f"load before: {Path('/proc/loadavg').read_text().strip()}")
        read_all(inputs)  # warm the page cache
        methods = {"ram": R.Ram(), "task_arithmetic": R.TaskArithmetic(), "ties": R.Ties()}
        base_mbs: list[float] = []
        mbs: dict[str, list[float]] = {m: [] for m in methods}
        ratios: dict[str, list[float]] = {m: [] for m in methods}
        floor_ratios: dict[str, list[float]] = {m: [] for m in methods}
        floor_mbs: dict[str, list[float]] = {m: [] for m in methods}
        cpu_ratios: dict[str, list[float]] = {m: [] for m in methods}
        growth: dict[str, int] = {}
        for _ in range(args.runs):
            t, c = time.perf_counter(), cpu_s()
            read_all(inputs)
            baseline = total / 1e6 / (time.perf_counter() - t)
            base_cpu = cpu_s() - c
            base_mbs.append(baseline)
            for name, cfg in methods.items():
                secs, cpu, grew = timed_merge(inputs, cfg, tmp / f"out-{name}")
                mbs[name].append(total / 1e6 / secs)
                ratios[name].append(total / 1e6 / secs / baseline)
                cpu_ratios[name].append(base_cpu / cpu)
                growth[name] = max(growth.get(name, 0), grew)
                out_dir = tmp / f"out-{name}"
                out_bytes = sum(f.stat().st_size for f in out_dir.glob("*.safetensors"))
                shutil.rmtree(out_dir)
                floor = io_floor(inputs, out_bytes, tmp / "floor.bin")
                floor_mbs[name].append(total / 1e6 / floor)
                floor_ratios[name].append(floor / secs)
        print(f"baseline (safe_open read only): {spread(base_mbs)} MB/s")
        for name in methods:
            r, rc = ratios[name], cpu_ratios[name]
            print(f"{name}: {spread(mbs[name])} MB/s, ratio {statistics.median(r):.2f} "
                  f"({min(r):.2f}-{max(r):.2f}); CPU-time ratio {statistics.median(rc):.2f} "
                  f"({min(rc):.2f}-{max(rc):.2f}); peak RSS +{growth[name] / 1e6:.0f} MB")  # fmt: skip
            fr = floor_ratios[name]
            print(f"  {name} vs its I/O floor (read the inputs once + write its output once, "
                  f"{spread(floor_mbs[name])} MB/s): {statistics.median(fr):.2f} "
                  f"({min(fr):.2f}-{max(fr):.2f})")  # fmt: skip
        print(f"load after: {Path('/proc/loadavg').read_text().strip()}")
        mk = vs_mergekit(args.mergekit, inputs, tmp, args.runs) if args.vs_mergekit else None
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        med = {m: statistics.median(v) for m, v in mbs.items()}
        print(json.dumps({
            "bench": "merge", "ours": round(med["ram"], 1),
            "baseline": round(statistics.median(base_mbs), 1),
            "ratio": round(statistics.median(ratios["ram"]), 3), "method": "ram",
            "ratios": {m: round(statistics.median(v), 3) for m, v in ratios.items()},
            "floor_ratios": {m: round(statistics.median(v), 3) for m, v in floor_ratios.items()},
            "floor_mb_s": {m: round(statistics.median(v), 1) for m, v in floor_mbs.items()},
            "ratio_spread": {m: [round(min(v), 3), round(max(v), 3)] for m, v in ratios.items()},
            "cpu_ratios": {m: round(statistics.median(v), 3) for m, v in cpu_ratios.items()},
            "mb_s": {m: round(v, 1) for m, v in med.items()}, "runs": args.runs,
            "threads": args.threads, "input_mb": round(total / 1e6),
            "peak_rss_mb": round(rss / 1e6),
            "peak_rss_growth_mb": {k: round(v / 1e6) for k, v in growth.items()},
            "loadavg": Path("/proc/loadavg").read_text().split()[:3],
            "vs_mergekit": mk,
        }))  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
