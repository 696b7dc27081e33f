"""The megatron-core trainer backend against the torch backend on the same model and batch
(fp32, one process, CPU): parity of the loss and gradients, and step time.

    PYTHONPATH=.venv-megatron/site .venv/bin/python bench/megatron_trainer.py [--model tiny:demo]

(`make test-megatron` installs megatron-core into .venv-megatron/site.)

Prints the largest |loss difference| and the smallest per-parameter gradient cosine over a few
losses, then the median train_step time of each backend.
Last line: {"bench": "megatron_trainer", "ours": <megatron s/step>, "baseline": <torch s/step>,
"ratio": <megatron / torch>}
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from rl360.policies.loading import resolve_model_path
from rl360.policies.megatron.convert import mcore_to_hf
from rl360.policies.megatron.trainer import MegatronTrainer
from rl360.policies.trainer_torch import TorchTrainer
from rl360.recipe import LossSection, TrainerSection
from rl360.types import Batch, TrainSample


def batch(n: int, length: int, seed: int) -> Batch:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        mask = [0] * 8 + [1] * (length - 8)
        out.append(TrainSample(tokens=[rng.randrange(256) for _ in range(length)], mask=mask,
                               sampling_logprobs=[-5.5 + rng.gauss(0, 0.3) if m else 0.0
                                                  for m in mask],
                               advantage=rng.gauss(0, 1)))
    return Batch(samples=out)


def grads_at_step(t: Any, names: dict[int, str]) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    step = t.optimizer.step

    def record(*a: Any, **k: Any) -> Any:
        got.update({names[id(p)]: p.grad.clone() for p in t.params if p.grad is not None})
        return step(*a, **k)

    t.optimizer.step = record
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny:demo")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = resolve_model_path(args.model)
    worst_loss, worst_cos = 0.0, 1.0
    for loss in (LossSection(name="ppo"), LossSection(name="gspo", reducer="seq-mean-token-mean")):
        cfg = TrainerSection(lr=1e-4, micro_batch_size=8, grad_clip=0.0, loss=loss)
        ref, meg = TorchTrainer(cfg, path), MegatronTrainer(cfg, path)
        g_ref = grads_at_step(ref, {id(p): n for n, p in ref.model.named_parameters()})
        g_meg = grads_at_step(meg, {id(p): n for n, p in meg.model.named_parameters()})
        b = batch(args.seqs, args.length, seed=1)
        m_ref, m_meg = ref.train_step(b), meg.train_step(b)
        worst_loss = max(worst_loss, abs(m_ref["loss"] - m_meg["loss"]))
        as_hf = mcore_to_hf(g_meg, meg.shape)
        for name, g in g_ref.items():
            cos = torch.nn.functional.cosine_similarity(g.flatten().double(),
                                                        as_hf[name].flatten().double(), dim=0)
            worst_cos = min(worst_cos, float(cos))
    print(f"parity on {args.model}: max |loss diff| {worst_loss:.2e}, "
          f"min grad cosine {worst_cos:.7f}")
    cfg = TrainerSection(lr=1e-4, micro_batch_size=8)
    times: dict[str, float] = {}
    for name, t in (("torch", TorchTrainer(cfg, path)), ("megatron", MegatronTrainer(cfg, path))):
        spent = []
        for s in range(args.steps + 1):
            t0 = time.perf_counter()
            t.train_step(batch(args.seqs, args.length, seed=10 + s))
            spent.append(time.perf_counter() - t0)
        times[name] = statistics.median(spent[1:])  # the first step warms up
        print(f"{name}: {times[name]:.3f} s/step ({args.seqs} x {args.length} tokens)")
    print(json.dumps({"bench": "megatron_trainer", "ours": round(times["megatron"], 4),
                      "baseline": round(times["torch"], 4),
                      "ratio": round(times["megatron"] / times["torch"], 3)}))


if __name__ == "__main__":
    main()
