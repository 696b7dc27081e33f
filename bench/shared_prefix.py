"""A torch trainer step with shared prompts (`trainer.shared_prefix`, the default: a GRPO
group's prompt runs through the model once per micro-batch) vs every sample's full row, on
batches shaped like the SmolLM2 tool tasks.

    .venv/bin/python bench/shared_prefix.py [--model smollm2] [--recipe recipes/smollm2-tools.toml]
                                            [--groups 4] [--runs 3] [--threads 2]

Workload, seeded: `--groups` groups x the recipe's group size, each group one prompt of
`--prompt` tokens (210: the tool tasks' system prompt, bash tool and task), each sample two
replies of 20-45 tokens with a tool result of 15-60 tokens between them (mask 0), advantages of
both signs; the recipe's trainer section (LoRA, PPO, micro-batches). Two trainers from the same
weights, one per path, step on the same batches alternating (`--steps` a run); per run the mean
seconds a step, median and spread of `--runs` runs. Both must give the same step (printed: the
relative difference of the first step's gradient norm).
Last line: {"bench": "shared_prefix", "ours": <shared s/step>, "baseline": <full s/step>,
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

from rl360.policies.loading import resolve_model_path
from rl360.recipe import load_recipe
from rl360.types import Batch, TrainSample

ROOT = Path(__file__).resolve().parents[1]


def tool_batch(seed: int, vocab: int, groups: int, size: int, prompt_len: int) -> Batch:
    rng = random.Random(seed)
    samples = []
    for _ in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for _ in range(size):
            first = [rng.randrange(3, vocab) for _ in range(rng.randint(20, 45))]
            tool = [rng.randrange(3, vocab) for _ in range(rng.randint(15, 60))]
            last = [rng.randrange(3, vocab) for _ in range(rng.randint(10, 30))]
            tokens = prompt + first + tool + last
            mask = [0] * prompt_len + [1] * len(first) + [0] * len(tool) + [1] * len(last)
            samples.append(TrainSample(
                tokens=tokens, mask=mask,
                sampling_logprobs=[-3.0 + rng.gauss(0, 0.3) if m else 0.0 for m in mask],
                advantage=rng.choice([-1.0, 1.0]) * rng.uniform(0.3, 1.5)))
    return Batch(samples=samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2-tools.toml"))
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=210)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="batches a run (each path)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from rl360.policies.trainer_torch import TorchTrainer

    torch.set_num_threads(a.threads)
    recipe = load_recipe(a.recipe)
    path = resolve_model_path(a.model)
    size = recipe.train.group_size
    trainers = {}
    for shared in (True, False):
        cfg = msgspec.structs.replace(recipe.trainer, shared_prefix=shared, threads=a.threads)
        trainers[shared] = TorchTrainer(cfg, path, temperature=recipe.train.sampling.temperature,
                                        seed=recipe.run.seed)
    vocab = trainers[True].vocab
    print(f"workload: {a.model}, {a.groups} groups x {size} samples, prompt {a.prompt} tokens, "
          f"replies 2 x 10-45 + tool 15-60; trainer {recipe.trainer.backend} "
          f"lora={'rank ' + str(recipe.trainer.lora.rank) if recipe.trainer.lora else 'off'} "
          f"micro_batch_size {recipe.trainer.micro_batch_size}, {a.threads} threads")
    first = {s: trainers[s].train_step(tool_batch(0, vocab, a.groups, size, a.prompt))
             for s in (True, False)}
    gdiff = abs(first[True]["grad_norm"] - first[False]["grad_norm"]) / first[False]["grad_norm"]
    print(f"same step: grad norm {first[True]['grad_norm']:.6g} vs {first[False]['grad_norm']:.6g}"
          f" (relative difference {gdiff:.1e})")
    per: dict[bool, list[float]] = {True: [], False: []}
    seed = 1
    for run in range(a.runs):
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(a.steps):
            batch = tool_batch(seed, vocab, a.groups, size, a.prompt)
            seed += 1
            order = (True, False) if (run + seed) % 2 else (False, True)
            for s in order:
                t0 = time.perf_counter()
                trainers[s].train_step(batch)
                times[s].append(time.perf_counter() - t0)
        for s in (True, False):
            per[s].append(statistics.mean(times[s]))
        print(f"run {run + 1}: shared {per[True][-1]:.2f} s/step, full rows "
              f"{per[False][-1]:.2f} s/step")
    ours, base = statistics.median(per[True]), statistics.median(per[False])
    print(f"shared prompts {ours:.2f} s/step ({min(per[True]):.2f}-{max(per[True]):.2f}), "
          f"full rows {base:.2f} ({min(per[False]):.2f}-{max(per[False]):.2f}): ratio "
          f"{ours / base:.2f}")
    print(json.dumps({"bench": "shared_prefix", "ours": ours, "baseline": base,
                      "ratio": ours / base, "grad_norm_rel_diff": gdiff, "groups": a.groups,
                      "group_size": size, "prompt": a.prompt, "threads": a.threads}))


if __name__ == "__main__":
    main()
