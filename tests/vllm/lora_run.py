"""Runs the torch trainer with trainer.lora and the vLLM backend side by side: 3 adapter versions
from real trainer steps, each through the object-store packing (pack_adapter / unpack_adapter)
into vLLM's LoRA path (VLLMBackend.update_weights with an AdapterUpdate), and writes, per
version, vLLM's greedy and sampled tokens with their logprobs beside the trainer's own logprobs
of the same tokens. A script, not a test module: vLLM's engine core starts with multiprocessing
spawn (see parity_run.py).

    python tests/vllm/lora_run.py MODEL OUT.json
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import torch

from rl360.recipe import EngineSection, LoraSection, ModelSection, TrainerSection
from rl360.types import Batch, SamplingParams, TrainSample

PROMPTS = [[1, 5, 9, 17, 33, 60], [2, 40, 41, 42, 7, 8, 99], list(range(60, 80))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=10, seed=3)


def samples(seed: int, vocab: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    return [TrainSample(tokens=torch.randint(3, vocab, (16,), generator=g).tolist(),
                        mask=[0] * 4 + [1] * 12, sampling_logprobs=[0.0] * 4 + [-5.0] * 12,
                        advantage=1.0 if i % 2 else -1.0) for i in range(8)]


def trainer_logprobs(model: Any, prompt: list[int], out: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + out])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]


async def main(model: str) -> dict[str, Any]:
    from rl360.policies.loading import resolve_model_path
    from rl360.policies.trainer_torch import TorchTrainer
    from rl360.serve.engines.support import adapter_options
    from rl360.serve.engines.vllm_backend import VLLMBackend
    from rl360.weights.adapters import pack_adapter, unpack_adapter

    lora = LoraSection(rank=8, alpha=16.0)
    trainer = TorchTrainer(TrainerSection(lr=2e-2, lora=lora), resolve_model_path(model))
    opts = adapter_options("vllm", lora.rank, list(lora.targets))
    engine = VLLMBackend(EngineSection(backend="vllm", max_batch_size=8, options=opts),
                         ModelSection(path=model, max_model_len=256))
    res: dict[str, Any] = {"model": model, "versions": []}
    try:
        base = await engine.generate(PROMPTS[0], GREEDY)
        res["base"] = {"ids": base.token_ids, "logprobs": base.logprobs}
        for version in (1, 2, 3):
            trainer.train_step(Batch(samples=samples(version, trainer.vocab)))
            update = unpack_adapter(pack_adapter(version, trainer.lora,
                                                 trainer.adapter_for_sync()))
            ok = await engine.update_weights(version, update)
            rows = []
            for sp in (GREEDY, SAMPLED):
                gens = await asyncio.gather(*(engine.generate(p, sp) for p in PROMPTS))
                for p, g in zip(PROMPTS, gens, strict=True):
                    rows.append({"greedy": sp.temperature == 0.0, "ids": g.token_ids,
                                 "vllm": g.logprobs, "version": g.policy_version,
                                 "trainer": trainer_logprobs(trainer.model, p, g.token_ids)})
            res["versions"].append({"version": version, "applied": ok, "rows": rows})
        res["stale_refused"] = not await engine.update_weights(3, update)
        res["health"] = engine.health()
    finally:
        await engine.close()
    return res


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: lora_run.py MODEL OUT.json")
    Path(sys.argv[2]).write_text(json.dumps(asyncio.run(main(sys.argv[1]))))
