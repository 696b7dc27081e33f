"""A torch trainer step with LoRA adapters (`trainer.lora`) against full fine-tuning on the same
batch, and our adapter module against peft's on the same trainer, plus each one's import cost.

    .venv/bin/python bench/lora_step.py [--model smollm2] [--runs 3] [--threads 2] [--rank 16]

Workload: `--model` (default SmolLM2-135M-Instruct, "smollm2"; any model path the recipe takes),
the `--recipe` trainer section (default recipes/smollm2-tools.toml: PPO, micro-batches of 8;
off-policy guards off, the sampling logprobs being made up; lr 1e-5; its [trainer.lora] left
out: the three trainers below set their own) with `--threads` torch threads, one seeded batch of 8 groups x 4
samples (prompts of 60-120 tokens, completions of 20-100; printed: its tokens), adapters of
`--rank` (alpha 2 x rank) on q/k/v/o/gate/up/down. Three trainers start from the same weights:
full fine-tuning, our adapters (rl360.policies.lora.LoraLinear) and peft's (peft's LoRA layer
injected into the same trainer's model, only its adapters trainable). Each run steps each
trainer once on the batch, in rotating order; the first run is a warm-up; median and spread of
`--runs` runs, in wall seconds and in CPU seconds of this process (all its threads: on a box
whose cores other work shares, the CPU seconds a step are the figure that holds). Also timed per run: `state_dict_for_sync` (what the trainer hands the weight
sync: the weights, or with adapters the merged weights). Import cost: CPU seconds of a fresh
interpreter importing torch, rl360.policies.lora, and peft (median of 3 each).
Last line: {"bench": "lora_step", "ours": <LoRA CPU s/step>, "baseline": <full CPU s/step>,
"ratio": ours / baseline, "wall_s": {...}, "peft_cpu_s": ..., "import_cpu_s": {...}, ...}
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from rl360.recipe import LORA_TARGETS, LoraSection, Recipe, load
from rl360.types import Batch, TrainSample

ROOT = Path(__file__).resolve().parents[1]


def batch_of(seed: int, vocab: int, groups: int = 8, size: int = 4) -> Batch:
    rng = random.Random(seed)
    samples = []
    for _ in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(60, 120))]
        rewards = [float(rng.random() < 0.5) for _ in range(size)]
        if len(set(rewards)) == 1:
            rewards[0] = 1.0 - rewards[0]
        mean = sum(rewards) / size
        for r in rewards:
            n = rng.randint(20, 100)
            out = [rng.randrange(3, vocab) for _ in range(n)]
            samples.append(TrainSample(
                tokens=prompt + out, mask=[0] * len(prompt) + [1] * n,
                sampling_logprobs=[0.0] * len(prompt) + [-rng.uniform(0.1, 3.0) for _ in out],
                advantage=r - mean, reward=r))
    return Batch(samples=samples)


def import_cpu_seconds(module: str, runs: int = 3) -> float:
    code = (f"import resource, {module}; r = resource.getrusage(resource.RUSAGE_SELF); "
            "print(r.ru_utime + r.ru_stime)")
    xs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout) for _ in range(runs)]
    return statistics.median(xs)


def peft_trainer(section: Any, path: Path, rank: int) -> Any:
    """The full fine-tuning trainer with peft's LoRA layers injected into its model, only
    their adapters trainable, and its optimizer rebuilt over them."""
    import peft

    from rl360.policies.trainer_torch import TorchTrainer

    t = TorchTrainer(section, path)
    conf = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                           target_modules=list(LORA_TARGETS))
    t.model = peft.inject_adapter_in_model(conf, t.model)
    for n, p in t.model.named_parameters():
        p.requires_grad_("lora_" in n)
    t._setup_optimization(section)
    return t


def main() -> None:
    from rl360.policies.loading import resolve_model_path
    from rl360.policies.trainer_torch import TorchTrainer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2-tools.toml"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--no-peft", action="store_true", help="skip peft's trainer")
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    torch.set_num_threads(args.threads)
    section = load(args.recipe, Recipe).trainer
    section = msgspec.structs.replace(section, lr=1e-5, warmup_steps=0, lora=None,
                                      loss=msgspec.structs.replace(section.loss, seq_mask=0.0,
                                                                   behaviour_clip=False))
    lora = msgspec.structs.replace(section, lora=LoraSection(
        rank=args.rank, alpha=2.0 * args.rank, targets=list(LORA_TARGETS)))
    imports = {m: import_cpu_seconds(m) for m in ("torch", "rl360.policies.lora", "peft")}
    trainers: dict[str, Any] = {"full": TorchTrainer(section, path),
                                "lora": TorchTrainer(lora, path)}
    if not args.no_peft:
        trainers["peft"] = peft_trainer(section, path, args.rank)
    vocab = trainers["full"].vocab
    batch = batch_of(0, vocab)
    tokens = sum(len(s.tokens) for s in batch.samples)
    loss_tokens = sum(sum(s.mask) for s in batch.samples)
    trainable = {k: sum(p.numel() for p in t.params) for k, t in trainers.items()}
    total = sum(p.numel() for p in trainers["full"].model.parameters())
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    print(f"model {args.model} ({total / 1e6:.1f}M parameters), {len(batch.samples)} samples "
          f"({tokens} tokens, {loss_tokens} loss tokens), micro-batches of "
          f"{section.micro_batch_size}, {args.threads} torch thread(s); rank {args.rank} on "
          f"{', '.join(LORA_TARGETS)}: {trainable['lora'] / 1e6:.2f}M trainable; {args.runs} "
          f"runs + 1 warm-up, rotating; load {' '.join(load_before)}", flush=True)
    steps: dict[str, list[float]] = {k: [] for k in trainers}
    cpu: dict[str, list[float]] = {k: [] for k in trainers}
    syncs: dict[str, list[float]] = {k: [] for k in trainers if k != "peft"}
    names = list(trainers)
    for run in range(args.runs + 1):
        order = names[run % len(names):] + names[: run % len(names)]
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            m = trainers[name].train_step(batch)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if name in syncs:
                t1 = time.perf_counter()
                trainers[name].state_dict_for_sync()
                sync = time.perf_counter() - t1
            if run:
                steps[name].append(dt)
                cpu[name].append(dc)
                if name in syncs:
                    syncs[name].append(sync)
            print(f"  run {run} {name:4s} {dt:7.2f} s, {dc:7.2f} CPU s (grad norm "
                  f"{m['grad_norm']:.4f})", flush=True)
    med = {k: statistics.median(v) for k, v in steps.items()}
    mcpu = {k: statistics.median(v) for k, v in cpu.items()}
    for k, xs in steps.items():
        extra = (f"; state_dict_for_sync {statistics.median(syncs[k]):.3f} s" if k in syncs
                 else "")
        print(f"{k:5s} {mcpu[k]:.2f} CPU s a step (min {min(cpu[k]):.2f}, max {max(cpu[k]):.2f}); "
              f"{med[k]:.2f} s wall (min {min(xs):.2f}, max {max(xs):.2f}){extra}")
    print(f"ratio {mcpu['lora'] / mcpu['full']:.3f} in CPU s, {med['lora'] / med['full']:.3f} in "
          "wall s (LoRA / full; below 1 is faster)")
    if "peft" in med:
        print(f"peft's layer: {mcpu['peft']:.2f} CPU s a step, {mcpu['peft'] / mcpu['lora']:.3f} "
              "x ours")
    print("import CPU s (fresh interpreter, median of 3): "
          + ", ".join(f"{k} {v:.2f}" for k, v in imports.items()))
    rusage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({
        "bench": "lora_step", "ours": round(mcpu["lora"], 3), "baseline": round(mcpu["full"], 3),
        "ratio": round(mcpu["lora"] / mcpu["full"], 3), "unit": "CPU s/step (median)",
        "wall_s": {k: round(v, 3) for k, v in med.items()},
        "peft_cpu_s": round(mcpu["peft"], 3) if "peft" in mcpu else None,
        "sync_s": {k: round(statistics.median(v), 3) for k, v in syncs.items()},
        "import_cpu_s": {k: round(v, 2) for k, v in imports.items()},
        "trainable": trainable, "tokens": tokens, "runs": args.runs, "model": args.model,
        "threads": args.threads, "load": load_before,
        "max_rss_mb": round(rusage.ru_maxrss / 1024)}))


if __name__ == "__main__":
    main()
