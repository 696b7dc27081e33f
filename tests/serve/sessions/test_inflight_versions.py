"""A weight update that lands while a session's reply is being generated: the session's
ledger keeps each generated token's own policy version (old ones, then new ones)."""

from __future__ import annotations

import asyncio

import msgspec
import torch

from rl360.recipe import EngineSection, ModelSection, ServeSection
from rl360.serve.engines.torch_backend import TorchBackend, load_causal_lm
from rl360.serve.sessions.openai_types import ChatCompletionRequest
from rl360.serve.sessions.service import LocalEngineClient, SessionService
from rl360.weights.payloads import TensorUpdate


async def test_ledger_records_the_version_of_every_token_across_an_inflight_update(
        tiny_dir, renderer) -> None:  # type: ignore[no-untyped-def]
    model, tok = load_causal_lm(str(tiny_dir), "float32")
    be = TorchBackend(EngineSection(batch_wait_ms=0), ModelSection(), model=model, tokenizer=tok)
    svc = SessionService(renderer, LocalEngineClient(be), ServeSection(),
                         max_model_len=ModelSection().max_model_len, model_name="rl360")
    s = svc.open()
    req = msgspec.convert({"messages": [{"role": "user", "content": "count"}], "max_tokens": 60,
                           "temperature": 0}, ChatCompletionRequest)
    reply = asyncio.create_task(svc.chat(s["id"], s["token"], req))
    for _ in range(100_000):  # until the engine has generated a few tokens of the reply
        if be.health()["steps"] >= 5 or reply.done():
            break
        await asyncio.sleep(0.001)
    new = {k: v + 0.1 * torch.randn_like(v) for k, v in model.state_dict().items()}
    assert await be.update_weights(1, TensorUpdate(new))
    await reply
    traj = svc.trajectory(s["id"], s["token"])
    gen = [v for v, m in zip(traj["versions"], traj["mask"], strict=True) if m]
    assert 0 in gen and 1 in gen, gen
    switch = gen.index(1)
    assert gen == [0] * switch + [1] * (len(gen) - switch)
    assert traj["counters"].get("mixed_version_turns") == 1
