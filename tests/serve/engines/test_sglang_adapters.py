"""Adapter versions on the SGLang backend in HTTP mode against the fake SGLang server: each
version is a peft directory loaded under its own name, new requests carry it, a running request
keeps the adapter it started with (one version per sequence, no pause), and an old adapter is
unloaded only once its last request has finished."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.sglang_backend import SGLangBackend
from rl360.serve.engines.sglang_mapping import engine_kwargs
from rl360.serve.engines.support import adapter_options
from rl360.types import SamplingParams
from rl360.weights.payloads import AdapterUpdate
from tests.serve.engines.fake_sglang import FakeSGLang

TARGETS = ["q_proj", "v_proj"]


@pytest.fixture
async def fake() -> AsyncIterator[FakeSGLang]:
    server = await FakeSGLang().start()
    try:
        yield server
    finally:
        await server.stop()


def _backend(tmp_path: Path, url: str) -> SGLangBackend:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    options = {"mode": "http", "url": url, **adapter_options("sglang", 4, TARGETS)}
    return SGLangBackend(EngineSection(backend="sglang", options=options),
                         ModelSection(path=str(tmp_path), max_model_len=256))


def _adapter(seed: int) -> AdapterUpdate:
    g = torch.Generator().manual_seed(seed)
    tensors = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 8, generator=g),
               "model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(8, 4, generator=g)}
    return AdapterUpdate(rank=4, alpha=8.0, targets=TARGETS, tensors=tensors)


async def _until(cond: Any) -> None:
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


def test_sglang_starts_with_lora_for_the_adapter_shape() -> None:
    opts = adapter_options("sglang", 16, ["q_proj", "down_proj"])
    kw = engine_kwargs(EngineSection(backend="sglang", options=opts), ModelSection(), 0, "/m")
    assert kw["enable_lora"] is True and kw["max_lora_rank"] == 16
    assert kw["lora_target_modules"] == ["q_proj", "down_proj"]
    assert adapter_options("vllm", 12, [])["max_lora_rank"] == 16  # vLLM's next rank
    assert adapter_options("torch", 16, []) == {}


async def test_adapter_versions_load_by_name_and_unload_when_unused(tmp_path: Path,
                                                                     fake: FakeSGLang) -> None:
    fake.token_delay_s = 0.01
    be = _backend(tmp_path, fake.url)
    try:
        base = asyncio.create_task(be.generate([1], SamplingParams(max_tokens=30)))
        await _until(fake.generating)  # the base request, not the health probe
        assert await be.update_weights(1, _adapter(1)) is True
        v1 = await be.generate([1], SamplingParams(max_tokens=2))
        long_v1 = asyncio.create_task(be.generate([1], SamplingParams(max_tokens=40)))
        await _until(lambda: any(r.adapter == "rl360-v1" for r in fake.running.values()))
        assert await be.update_weights(2, _adapter(2)) is True
        v2 = await be.generate([1], SamplingParams(max_tokens=2))
        assert "rl360-v1" in fake.adapters  # its request still runs
        gen_base, gen_v1 = await base, await long_v1
        await _until(lambda: "rl360-v1" not in fake.adapters)
        assert await be.update_weights(2, _adapter(3)) is False  # versions only move forward
    finally:
        await be.close()
    [load1, load2] = fake.called("/load_lora_adapter")
    assert load1["lora_name"] == "rl360-v1" and load2["lora_name"] == "rl360-v2"
    assert fake.called("/unload_lora_adapter") == [{"lora_name": "rl360-v1"}]
    assert fake.unloads_in_use == 0 and not fake.called("/pause_generation")
    # the base request and the long v1 request each kept what they started with
    assert gen_base.logprobs == [-0.01] * 30 and gen_base.policy_version == 0
    assert gen_v1.logprobs == [-0.11] * 40 and gen_v1.policy_version == 1
    assert not gen_base.mixed_versions and not gen_v1.mixed_versions
    assert v1.logprobs == [-0.11] * 2 and v1.policy_version == 1
    assert v2.logprobs == [-0.21] * 2 and v2.policy_version == 2
    sent = [b.get("lora_path") for b in fake.called("/generate")]
    assert sent == [None, "rl360-v1", "rl360-v1", "rl360-v2"]
