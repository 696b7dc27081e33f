"""A torch trainer step on a demo-shaped batch: loss-token logprobs through the output head in
chunks (`trainer.fused_logprobs`, the default) vs the full logits of every position (what a
causal LM's forward gives: `model(ids).logits`, then log_softmax and the entropy over them).

    .venv/bin/python bench/trainer_step.py [--model runs/cpu-demo-warmstart] [--runs 3]

Workload: the demo's shape, seeded: 32 groups x 8 samples, each group one prompt of 40-90
tokens and completions of 4-64 tokens; a quarter of the groups scored alike (advantage 0:
skipped by both paths, as in the demo); the recipe's trainer section (recipes/cpu-demo.toml:
PPO, micro-batches of 64; its off-policy guards off, the sampling logprobs being made up) with `--threads` torch threads. The model is `--model` when it is a
directory (the demo's warm start), else tiny:demo from its config. Two trainers start from the
same weights, one per path, and step on the same batches alternating (`--steps` a run, the
first run a warm-up); per run the mean seconds a step; median and spread of `--runs` runs.
Both paths must give the same step (printed: the relative difference of the first step's
gradient norm, from the same weights). Also printed: the logits the full path materialises per
micro-batch (rows x width x vocab x 4 bytes) against the fused path's chunk.
Last line: {"bench": "trainer_step", "ours": <fused s/step>, "baseline": <full s/step>,
"ratio": ours / baseline, ...}
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import msgspec
import torch

from rl360.recipe import Recipe, load
from rl360.types import Batch, TrainSample

ROOT = Path(__file__).resolve().parents[1]


def demo_batch(seed: int, vocab: int, groups: int = 32, size: int = 8) -> Batch:
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(40, 90))]
        alike = g % 4 == 0
        rewards = [1.0] * size if alike else [float(rng.random() < 0.6) for _ in range(size)]
        mean = sum(rewards) / size
        for r in rewards:
            n = rng.randint(4, 64)
            out = [rng.randrange(3, vocab) for _ in range(n)]
            samples.append(TrainSample(
                tokens=prompt + out, mask=[0] * len(prompt) + [1] * n,
                sampling_logprobs=[0.0] * len(prompt) + [-rng.uniform(0.1, 3.0) for _ in out],
                advantage=r - mean, reward=r))
    return Batch(samples=samples)


def main() -> None:
    from rl360.policies.loading import resolve_model_path
    from rl360.policies.token_logprobs import chunk_rows
    from rl360.policies.trainer_torch import TorchTrainer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "runs" / "cpu-demo-warmstart"))
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "cpu-demo.toml"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="batches a run (each path)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    model = args.model if (Path(args.model) / "config.json").is_file() else "tiny:demo"
    path = resolve_model_path(model)
    torch.set_num_threads(args.threads)
    section = load(args.recipe, Recipe).trainer
    # the batch's sampling logprobs are made up: the off-policy guards would mask every sequence
    # (a zero gradient); without them the step trains every loss token
    section = msgspec.structs.replace(section, loss=msgspec.structs.replace(
        section.loss, seq_mask=0.0, behaviour_clip=False))
    trainers = {f: TorchTrainer(msgspec.structs.replace(section, fused_logprobs=f), path)
                for f in (True, False)}
    vocab = trainers[True].vocab
    batches = [demo_batch(seed, vocab) for seed in range(args.steps)]
    first = {f: trainers[f].train_step(batches[0])["grad_norm"] for f in (True, False)}
    loss_rel = abs(first[True] - first[False]) / max(abs(first[False]), 1e-12)
    samples = batches[0].samples
    tokens = sum(len(s.tokens) for s in samples)
    loss_tokens = sum(sum(s.mask) for s in samples if s.advantage != 0)
    width = max(len(s.tokens) for s in samples)
    mb = section.micro_batch_size
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    print(f"model {model} (vocab {vocab}), {len(samples)} samples a batch ({tokens} tokens, "
          f"{loss_tokens} loss tokens with a nonzero advantage), micro-batches of {mb}, "
          f"{args.threads} torch thread(s), {args.steps} batches a run, {args.runs} runs + 1 "
          f"warm-up, alternating; load {' '.join(load_before)}", flush=True)
    print(f"full logits per micro-batch up to {mb * width * vocab * 4 / 2**20:.0f} MB; fused "
          f"chunk {chunk_rows(vocab, torch.device('cpu')) * vocab * 4 / 2**20:.0f} MB; first "
          f"step's gradient norm fused {first[True]:.6f} full {first[False]:.6f} (rel. diff "
          f"{loss_rel:.1e})", flush=True)
    per: dict[bool, list[float]] = {True: [], False: []}
    for run in range(args.runs + 1):
        for fused in (False, True):
            t = time.perf_counter()
            for b in batches:
                trainers[fused].train_step(b)
            if run:
                per[fused].append((time.perf_counter() - t) / len(batches))
    ours, base = statistics.median(per[True]), statistics.median(per[False])
    for fused, name in ((True, "fused"), (False, "full logits")):
        xs = per[fused]
        print(f"{name:12s} {statistics.median(xs):.3f} s a step (min {min(xs):.3f}, "
              f"max {max(xs):.3f})")
    print(f"ratio {ours / base:.3f} (fused / full; below 1 is faster)")
    print(json.dumps({"bench": "trainer_step", "ours": round(ours, 4), "baseline": round(base, 4),
                      "ratio": round(ours / base, 3), "unit": "s/step (median)",
                      "runs": args.runs, "model": model, "vocab": vocab,
                      "first_grad_norm_rel_diff": loss_rel, "load": load_before}))


if __name__ == "__main__":
    main()
