"""Serve overhead: the same generation work (a) direct to the torch backend in process and
(b) through the session server over HTTP with N concurrent sessions.

    .venv/bin/python bench/serve_overhead.py [--sessions 16] [--requests 8] [--max-tokens 96]

Prints tokens/s of each; the last line is
{"bench": "serve_overhead", "ours": <server tok/s>, "baseline": <direct tok/s>, "ratio": ours/baseline}
Both sides use the same prompts, seeds, sampling and torch thread count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

MESSAGES = [{"role": "system", "content": "You write short Python functions."},
            {"role": "user", "content": "Write add_seven(x) that returns x plus 7."}]


async def direct(args: argparse.Namespace) -> tuple[float, int]:
    from rl360.policies.chat import ChatRenderer
    from rl360.policies.loading import load_tokenizer
    from rl360.recipe import EngineSection, ModelSection
    from rl360.serve.engines.torch_backend import TorchBackend
    from rl360.types import Message, SamplingParams

    be = TorchBackend(EngineSection(max_batch_size=64, batch_wait_ms=5.0, threads=args.threads),
                      ModelSection(path="tiny"))
    r = ChatRenderer(load_tokenizer("tiny"))
    ids = r.render([Message(**m) for m in MESSAGES], None, add_generation_prompt=True)

    async def worker(w: int) -> int:
        n = 0
        for i in range(args.requests):
            sp = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=w * 1000 + i,
                                eos_token_ids=r.eos_ids)
            n += len((await be.generate(ids, sp)).token_ids)
        return n

    await worker(0)  # warm up
    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(worker(w) for w in range(args.sessions))))
    return time.perf_counter() - t0, tokens


async def through_server(args: argparse.Namespace, base_url: str) -> tuple[float, int]:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=600,
                                 limits=httpx.Limits(max_connections=args.sessions * 2)) as c:

        async def worker(w: int) -> int:
            s = (await c.post("/sessions")).json()
            h = {"Authorization": f"Bearer {s['token']}"}
            n = 0
            for i in range(args.requests):  # the same turn again: a retry, same prompt ids
                r = await c.post(f"/sessions/{s['id']}/v1/chat/completions", headers=h, json={
                    "messages": MESSAGES, "max_tokens": args.max_tokens, "temperature": 1.0,
                    "seed": w * 1000 + i})
                r.raise_for_status()
                n += r.json()["usage"]["completion_tokens"]
            return n

        await worker(0)
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(worker(w) for w in range(args.sessions))))
        return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    d_s, d_tok = asyncio.run(direct(args))
    d_tps = d_tok / d_s
    print(f"direct:  {d_tok} tokens in {d_s:.2f}s = {d_tps:.0f} tok/s")

    from rl360.launch.serve_app import start_serving, stop_serving
    from rl360.ray_session import ray_session
    from rl360.recipe import apply_overrides, decode_recipe

    recipe = decode_recipe(apply_overrides({}, [
        "engine.max_batch_size=64", "engine.batch_wait_ms=5.0", f"engine.threads={args.threads}",
        "engine.num_cpus=1",
    ]))
    with ray_session(num_cpus=2, dashboard=False, namespace="rl360-bench"):
        h = start_serving(recipe)
        try:
            s_s, s_tok = asyncio.run(through_server(args, h.base_url))
        finally:
            stop_serving(h)
    s_tps = s_tok / s_s
    print(f"server:  {s_tok} tokens in {s_s:.2f}s = {s_tps:.0f} tok/s "
          f"({args.sessions} sessions x {args.requests} requests over HTTP)")
    print(json.dumps({"bench": "serve_overhead", "ours": round(s_tps, 1),
                      "baseline": round(d_tps, 1), "ratio": round(s_tps / d_tps, 3)}))


if __name__ == "__main__":
    main()
