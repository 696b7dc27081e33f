"""The SGLang backend's HTTP mode against a fake SGLang server (tests/serve/engines/
fake_sglang.py): requests and answers, weight updates under each pause mode, aborts of
cancelled requests, and the generation probe of the replica's health check."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.sglang_backend import SGLangBackend, engine_kwargs
from rl360.types import SamplingParams
from rl360.weights.payloads import CollectiveUpdate
from tests.serve.engines.fake_sglang import FakeSGLang


@pytest.fixture
async def fake() -> AsyncIterator[FakeSGLang]:
    server = await FakeSGLang().start()
    try:
        yield server
    finally:
        await server.stop()


def _backend(tmp_path: Path, url: str, **options: Any) -> SGLangBackend:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return SGLangBackend(EngineSection(backend="sglang",
                                       options={"mode": "http", "url": url, **options}),
                         ModelSection(path=str(tmp_path), max_model_len=256))


def _update(version: int) -> CollectiveUpdate:
    return CollectiveUpdate(group_name="g", buckets=[[("w", [2], "torch.float32")]],
                            join=("127.0.0.1", 1, 1, 2, "nccl"))


async def _until(cond: Any) -> None:
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


def test_expert_parallel_reaches_sglang_as_ep_size() -> None:
    kw = engine_kwargs(EngineSection(tensor_parallel=4, expert_parallel=4), ModelSection(), 0,
                       "/m")
    assert (kw["tp_size"], kw["ep_size"]) == (4, 4)


async def test_generate_over_http(tmp_path: Path, fake: FakeSGLang) -> None:
    be = _backend(tmp_path, fake.url)
    try:
        gen = await be.generate([5, 6], SamplingParams(max_tokens=4, stop_token_ids=[9], seed=3))
    finally:
        await be.close()
    assert gen.token_ids == [7, 8, 9] and gen.logprobs == [-0.01] * 3
    assert (gen.finish_reason, gen.stop_kind, gen.policy_version) == ("stop", "stop_token", 0)
    body = fake.called("/generate")[-1]
    assert body["input_ids"] == [5, 6] and body["return_logprob"] is True
    assert isinstance(body["rid"], str) and len(body["rid"]) == 32
    assert body["sampling_params"]["sampling_seed"] == 3
    assert body["sampling_params"]["no_stop_trim"] is True


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_update_keeps_in_flight_requests(tmp_path: Path, fake: FakeSGLang,
                                               mode: str) -> None:
    fake.token_delay_s = 0.01
    be = _backend(tmp_path, fake.url, pause_mode=mode) if mode != "retract" else \
        _backend(tmp_path, fake.url)  # retract is the default
    try:
        task = asyncio.create_task(be.generate([1], SamplingParams(max_tokens=100)))
        await _until(fake.generating)
        await asyncio.sleep(0.05)  # a few tokens under the old weights
        assert await be.update_weights(1, _update(1)) is True
        gen = await task
    finally:
        await be.close()
    paths = [p for p, _ in fake.calls]
    i = paths.index("/pause_generation")
    assert paths[i:i + 4] == ["/pause_generation", "/init_weights_update_group",
                              "/update_weights_from_distributed", "/continue_generation"]
    assert fake.called("/pause_generation") == [{"mode": mode}]
    assert fake.called("/update_weights_from_distributed")[0]["flush_cache"] is (mode == "retract")
    assert fake.updates_while_running == 0
    # the request was kept: all 100 tokens, the first ones from the old weights, the rest new
    assert gen.finish_reason == "length" and len(gen.token_ids) == 100
    assert gen.logprobs[0] == -0.01 and gen.logprobs[-1] == -0.02
    assert gen.mixed_versions and gen.policy_version == 1 and set(gen.token_versions) == {0}
    assert be.version == 1


async def test_drain_waits_for_running_requests(tmp_path: Path, fake: FakeSGLang) -> None:
    fake.token_delay_s = 0.005
    be = _backend(tmp_path, fake.url, pause_mode="drain")
    try:
        task = asyncio.create_task(be.generate([1], SamplingParams(max_tokens=20)))
        await _until(fake.generating)
        assert await be.update_weights(1, _update(1)) is True
        gen = await task
        after = await be.generate([1], SamplingParams(max_tokens=2))
    finally:
        await be.close()
    assert not fake.called("/pause_generation") and fake.updates_while_running == 0
    assert gen.logprobs == [-0.01] * 20 and not gen.mixed_versions and gen.policy_version == 0
    assert after.logprobs == [-0.02] * 2 and after.policy_version == 1


async def test_abort_mode_ends_in_flight_requests(tmp_path: Path, fake: FakeSGLang) -> None:
    fake.token_delay_s = 0.01
    be = _backend(tmp_path, fake.url, pause_mode="abort")
    try:
        task = asyncio.create_task(be.generate([1], SamplingParams(max_tokens=500)))
        await _until(fake.generating)
        assert await be.update_weights(1, _update(1)) is True
        gen = await task
    finally:
        await be.close()
    assert gen.finish_reason == "abort" and len(gen.token_ids) < 500


async def test_cancelled_request_is_aborted_in_sglang(tmp_path: Path, fake: FakeSGLang) -> None:
    fake.token_delay_s = 0.01
    be = _backend(tmp_path, fake.url)
    try:
        task = asyncio.create_task(be.generate([1], SamplingParams(max_tokens=1000)))
        await _until(fake.generating)
        rid = next(iter(fake.running))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: not fake.running)  # SGLang stopped generating it
        assert fake.called("/abort_request") == [{"rid": rid}]
        assert be.health()["aborts"] == 1
    finally:
        await be.close()


async def test_health_check_probes_generation(tmp_path: Path, fake: FakeSGLang) -> None:
    from rl360.serve.engines.replica import EngineReplica

    (tmp_path / "config.json").write_text("{}")
    replica = EngineReplica(EngineSection(backend="sglang", options={
        "mode": "http", "url": fake.url, "probe_idle_s": 0.0}), ModelSection(path=str(tmp_path)))
    try:
        await replica.check_health()  # not started yet: nothing to probe
        assert fake.called("/health_generate") == []
        await replica.generate([1], SamplingParams(max_tokens=1))
        n = len(fake.called("/health_generate"))  # the client's start-up wait probes once
        await replica.check_health()
        assert len(fake.called("/health_generate")) == n + 1
        await replica.pause()  # paused (or updating): no probe, it would wait
        await replica.check_health()
        assert len(fake.called("/health_generate")) == n + 1
        await replica.resume()
        fake.healthy = False
        with pytest.raises(RuntimeError, match=r"sglang generation probe failed.*HTTP 503"):
            await replica.check_health()
    finally:
        await replica.backend.close()
