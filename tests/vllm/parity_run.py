"""Runs the torch and vLLM backends side by side on one model and writes what the parity
tests assert on, as JSON. A script, not a test module: vLLM's engine core is started with
multiprocessing spawn, so engine start-up must sit under `if __name__ == "__main__":`.

    python tests/vllm/parity_run.py MODEL OUT.json

The comparisons:
- greedy: the same prompts on both backends (vLLM gets them all at once, so batched);
- sampling: vLLM samples with temperature/top-k/top-p; the torch model scores the same
  tokens (teacher forcing) under the same processed distribution the torch backend samples
  from; the two logprob lists are written side by side;
- weight update: the same perturbed tensors (a fused-in-vLLM attention and MLP weight, and
  the embedding, tied to the LM head, and the final norm) go to both through
  update_weights(1, ...); greedy again on both;
  a second update_weights(1, ...) must be refused.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import torch

from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.torch_backend import processed_logprobs
from rl360.types import SamplingParams
from rl360.weights.payloads import TensorUpdate

PROMPTS = [
    "def add(a, b):",
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
]
MAX_TOKENS = 12
SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=MAX_TOKENS, seed=7)


@torch.no_grad()
def score(model: Any, prompt: list[int], out: list[int], sp: SamplingParams) -> list[float]:
    ids = torch.tensor([prompt + out])
    logits = model(input_ids=ids).logits[0].float()
    return [
        float(processed_logprobs(logits[len(prompt) - 1 + i], sp)[tok])
        for i, tok in enumerate(out)
    ]


def perturbed(model: Any) -> dict[str, torch.Tensor]:
    """The whole state dict with a few tensors changed enough to change greedy output: one
    attention projection (vLLM fuses it into qkv_proj), one MLP projection (fused into
    gate_up_proj), the embedding (tied to the LM head) and the final norm."""
    g = torch.Generator().manual_seed(1)
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, scale in (("model.layers.0.self_attn.q_proj.weight", 0.5),
                        ("model.layers.0.mlp.gate_proj.weight", 0.5),
                        ("model.embed_tokens.weight", 2.0)):
        v = out[name]
        out[name] = v + torch.randn(v.shape, generator=g) * v.std() * scale
    # the random tiny model greedily repeats the prompt's last token (tied embeddings: each
    # hidden state is closest to its own input row); a final norm with mixed signs breaks that
    out["model.norm.weight"] = torch.randn(out["model.norm.weight"].shape, generator=g)
    out.pop("lm_head.weight", None)  # tied to the embedding in both models
    return out


async def greedy(backend: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    gens = await asyncio.gather(*(backend.generate(p, sp) for p in prompts))
    return [{"ids": g.token_ids, "logprobs": g.logprobs, "version": g.policy_version}
            for g in gens]


async def stops(torch_b: Any, vllm_b: Any, tok: Any, prompts: list[list[int]],
                greedy_out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stop token, an EOS id and a stop string taken from each prompt's greedy output: both
    backends must stop on the same token with the same stop kind."""
    out = []
    for p, g in zip(prompts, greedy_out, strict=True):
        ids = g["ids"]
        text = tok.decode(ids[2:5], skip_special_tokens=False)
        cases = {
            "stop_token": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[ids[3]]),
            "eos": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, eos_token_ids=[ids[4]]),
        }
        if text.strip():
            cases["stop_string"] = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[text])
        for kind, sp in cases.items():
            t, v = await torch_b.generate(p, sp), await vllm_b.generate(p, sp)
            out.append({"kind": kind,
                        "torch": [t.token_ids, t.finish_reason, t.stop_kind, t.stop_string],
                        "vllm": [v.token_ids, v.finish_reason, v.stop_kind, v.stop_string]})
    return out


async def main(model: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from rl360.policies.loading import resolve_model_path
    from rl360.serve.engines.torch_backend import TorchBackend
    from rl360.serve.engines.vllm_backend import VLLMBackend

    tok = AutoTokenizer.from_pretrained(resolve_model_path(model))
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    cfg = (EngineSection(max_batch_size=8), ModelSection(path=model, max_model_len=512))
    # transformers' modules: `score` teacher-forces through the HF model's own forward
    torch_b = TorchBackend(EngineSection(max_batch_size=8, native_llama=False), cfg[1])
    vllm_b = VLLMBackend(*cfg)
    res: dict[str, Any] = {"model": model, "prompts": prompts}
    try:
        res["greedy_torch"] = await greedy(torch_b, prompts)
        res["greedy_vllm"] = await greedy(vllm_b, prompts)

        res["stops"] = await stops(torch_b, vllm_b, tok, prompts, res["greedy_torch"])

        sampled = await asyncio.gather(*(vllm_b.generate(p, SAMPLING) for p in prompts))
        res["sampled"] = [
            {"ids": g.token_ids, "vllm": g.logprobs,
             "torch": score(torch_b.model, p, g.token_ids, SAMPLING)}
            for p, g in zip(prompts, sampled, strict=True)
        ]
        # the same seed gives the same tokens on vLLM
        again = await vllm_b.generate(prompts[0], SAMPLING)
        res["seeded_repeat_same"] = again.token_ids == sampled[0].token_ids

        state = perturbed(torch_b.model)
        res["update_torch"] = await torch_b.update_weights(1, TensorUpdate(state))
        res["update_vllm"] = await vllm_b.update_weights(1, TensorUpdate(state))
        res["update_again_vllm"] = await vllm_b.update_weights(1, TensorUpdate(state))
        try:
            await vllm_b.update_weights(2, TensorUpdate({"no.such.weight": torch.zeros(2)}))
            res["unknown_name_refused"] = False
        except ValueError:
            res["unknown_name_refused"] = True
        res["greedy_torch_v1"] = await greedy(torch_b, prompts)
        res["greedy_vllm_v1"] = await greedy(vllm_b, prompts)
        res["vllm_health"] = vllm_b.health()
    finally:
        await vllm_b.close()
        await torch_b.close()
    return res


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: parity_run.py MODEL OUT.json")
    Path(sys.argv[2]).write_text(json.dumps(asyncio.run(main(sys.argv[1]))))
