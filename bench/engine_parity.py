"""Engine throughput, torch backend vs vLLM (CPU): the same model, the same prompts, the same
max tokens, all requests submitted at once to each backend (each batches them its own way);
greedy with EOS ignored, so both generate exactly the same number of tokens. Engine start-up
is excluded: each backend answers one warm-up request first. Runs from the vLLM tier's venv:

    .venv-vllm/bin/python bench/engine_parity.py [--model smollm2] [--requests 16] [--max-tokens 64]

Last line: {"bench": "engine_parity", "ours": <vllm tok/s>, "baseline": <torch tok/s>,
"ratio": <vllm/torch>}
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import time
from typing import Any

PROMPTS = [
    "def fibonacci(n):",
    "Explain what a hash map is.",
    "Write a function that reverses a string.",
    "The three laws of thermodynamics are",
    "import numpy as np\n\n",
    "Q: What is 17 * 23?\nA:",
    "List five prime numbers:",
    "class Stack:\n    def __init__(self):",
]


async def throughput(backend: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from rl360.types import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    await backend.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    t0 = time.perf_counter()
    gens = await asyncio.gather(*(backend.generate(p, sp) for p in prompts))
    wall = time.perf_counter() - t0
    tokens = sum(len(g.token_ids) for g in gens)
    return tokens / wall, tokens


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from rl360.policies.loading import resolve_model_path
    from rl360.recipe import EngineSection, ModelSection
    from rl360.serve.engines.torch_backend import TorchBackend
    from rl360.serve.engines.vllm_backend import VLLMBackend

    tok = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    texts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(args.requests)]
    prompts = [tok(t)["input_ids"] for t in texts]
    cfg = (EngineSection(max_batch_size=args.requests),
           ModelSection(path=args.model, max_model_len=1024))

    vllm_b = VLLMBackend(*cfg)
    try:
        v_tps, v_tokens = await throughput(vllm_b, prompts, args.max_tokens)
    finally:
        await vllm_b.close()
    torch_b = TorchBackend(*cfg)
    try:
        t_tps, t_tokens = await throughput(torch_b, prompts, args.max_tokens)
    finally:
        await torch_b.close()
    print(f"model {args.model}, {args.requests} requests x {args.max_tokens} max tokens (greedy)")
    print(f"vllm : {v_tokens} tokens, {v_tps:.1f} tok/s")
    print(f"torch: {t_tokens} tokens, {t_tps:.1f} tok/s")
    return {"bench": "engine_parity", "ours": round(v_tps, 2), "baseline": round(t_tps, 2),
            "ratio": round(v_tps / t_tps, 3)}


if __name__ == "__main__":
    if importlib.util.find_spec("vllm") is None:
        sys.exit("engine_parity: vllm is not installed in this interpreter; build the vLLM tier's "
                 "venv with `make test-vllm` and run .venv-vllm/bin/python bench/engine_parity.py")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="tiny[:preset] | smollm2 | an HF directory")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    result = asyncio.run(main(ap.parse_args()))
    print(json.dumps(result))
