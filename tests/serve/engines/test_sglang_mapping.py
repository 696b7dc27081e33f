"""The SGLang backend's CPU-side parts: request mapping, answer parsing, option split, the
server command line, and the version gate that keeps a sequence on one policy version. The
engine itself needs a GPU: tests/gpu/test_sglang_parity.py."""

from __future__ import annotations

import asyncio

import pytest

from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.base import BackendUnavailable, build_engine_backend
from rl360.serve.engines.gate import VersionGate
from rl360.serve.engines.sglang_backend import (
    engine_kwargs,
    sglang_installed,
    split_options,
    to_generation,
    to_sglang_sampling,
)
from rl360.serve.engines.sglang_client import check_result, server_command
from rl360.types import SamplingParams


def test_sampling_maps_to_sglang_names() -> None:
    sp = SamplingParams(temperature=0.0, top_k=0, max_tokens=7, stop=["\n\n"],
                        stop_token_ids=[5], eos_token_ids=[2, 5], seed=11)
    out = to_sglang_sampling(sp)
    assert out["max_new_tokens"] == 7 and out["temperature"] == 0.0 and out["top_k"] == -1
    assert out["stop_token_ids"] == [2, 5] and out["stop"] == ["\n\n"]
    assert out["sampling_seed"] == 11 and out["no_stop_trim"] is True
    assert "sampling_seed" not in to_sglang_sampling(sp, seed_param="")
    assert to_sglang_sampling(SamplingParams(top_k=20))["top_k"] == 20
    assert out["repetition_penalty"] == 1.0 and out["min_p"] == 0.0  # no model defaults
    assert to_sglang_sampling(SamplingParams(max_tokens=50), room=8)["max_new_tokens"] == 8
    with pytest.raises(ValueError, match="max_tokens"):
        to_sglang_sampling(SamplingParams(max_tokens=0))


def _answer(ids: list[int], finish: dict | None) -> dict:
    return {"text": "...", "output_ids": ids,
            "meta_info": {"finish_reason": finish,
                          "output_token_logprobs": [(-0.5 * (i + 1), t, None)
                                                    for i, t in enumerate(ids)]}}


def test_answers_become_generations() -> None:
    sp = SamplingParams(stop_token_ids=[9], eos_token_ids=[2])
    g = to_generation(_answer([4, 5, 2], {"type": "stop", "matched": 2}), sp, version=3)
    assert g.token_ids == [4, 5, 2] and g.logprobs == [-0.5, -1.0, -1.5]
    assert (g.finish_reason, g.stop_kind, g.policy_version) == ("stop", "eos", 3)
    assert g.token_versions == [3, 3, 3]
    g = to_generation(_answer([4, 9], {"type": "stop", "matched": 9}), sp, 0)
    assert g.stop_kind == "stop_token"
    g = to_generation(_answer([4, 10, 10], {"type": "stop", "matched": "\n\n"}), sp, 0)
    assert (g.stop_kind, g.stop_string) == ("stop_string", "\n\n")
    g = to_generation(_answer([4, 4], {"type": "length", "length": 2}), sp, 0)
    assert (g.finish_reason, g.stop_kind) == ("length", "")
    assert to_generation(_answer([4], {"type": "abort"}), sp, 0).finish_reason == "abort"


def test_bad_answers_fail_loudly() -> None:
    sp = SamplingParams()
    with pytest.raises(RuntimeError, match="output_token_logprobs"):
        to_generation({"meta_info": {}}, sp, 0)
    bad = _answer([1, 2], {"type": "length"})
    bad["output_ids"] = [1, 3]
    with pytest.raises(RuntimeError, match="disagree"):
        to_generation(bad, sp, 0)
    with pytest.raises(RuntimeError, match="finish_reason"):
        to_generation(_answer([1], {"type": "weird"}), sp, 0)


def test_options_split_ours_from_sglangs() -> None:
    cfg = EngineSection(max_batch_size=64, options={"mode": "http", "url": "http://h:1",
                                                    "mem_fraction_static": 0.8, "tp_size": 2})
    model = ModelSection(path="m", dtype="bfloat16", max_model_len=4096)
    own, extra = split_options(cfg.options)
    assert own.mode == "http" and own.url == "http://h:1"
    assert extra == {"mem_fraction_static": 0.8, "tp_size": 2}
    assert engine_kwargs(EngineSection(tensor_parallel=4), model, 0, "/m")["tp_size"] == 4
    kw = engine_kwargs(cfg, model, 3, "/models/x")
    assert kw["model_path"] == "/models/x" and kw["context_length"] == 4096
    assert kw["max_running_requests"] == 64 and kw["random_seed"] == 3
    assert kw["mem_fraction_static"] == 0.8 and "mode" not in kw and "url" not in kw
    assert kw["tp_size"] == 2  # options win over engine.tensor_parallel
    with pytest.raises(Exception, match="pause_mode"):
        split_options({"pause_mode": "sleep"})


def test_server_command_flags() -> None:
    cmd = server_command("py", "/m", 3000, {"tp_size": 2, "disable_radix_cache": True,
                                            "skip_me": False, "cuda_graph_bs": [1, 2]})
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    assert "--model-path" in cmd and cmd[cmd.index("--model-path") + 1] == "/m"
    assert cmd[cmd.index("--tp-size") + 1] == "2" and "--disable-radix-cache" in cmd
    assert "--skip-me" not in cmd and cmd[cmd.index("--cuda-graph-bs") + 1:][:2] == ["1", "2"]


def test_control_results_are_checked() -> None:
    check_result((True, "ok"), "x")
    check_result({"success": True}, "x")
    with pytest.raises(RuntimeError, match="update failed: shape"):
        check_result((False, "shape mismatch"), "update")
    with pytest.raises(RuntimeError, match="boom"):
        check_result({"success": False, "message": "boom"}, "y")


@pytest.mark.skipif(sglang_installed(), reason="sglang is installed here")
def test_missing_sglang_is_reported_by_the_factory() -> None:
    with pytest.raises(BackendUnavailable, match="sglang"):
        build_engine_backend(EngineSection(backend="sglang"), ModelSection())


async def test_gate_keeps_a_sequence_on_one_version() -> None:
    gate = VersionGate(0)
    events: list[str] = []
    release = asyncio.Event()

    async def request(tag: str, wait: bool) -> int:
        async with gate.reading() as v:
            events.append(f"{tag}@{v}")
            if wait:
                await release.wait()
            return v

    async def update() -> None:
        async with gate.writing():
            events.append("update")
            gate.version = 1

    first = asyncio.create_task(request("a", True), name="gate-test-a")
    await asyncio.sleep(0)
    upd = asyncio.create_task(update(), name="gate-test-update")
    await asyncio.sleep(0)
    late = asyncio.create_task(request("b", False), name="gate-test-b")  # queued behind update
    for _ in range(5):
        await asyncio.sleep(0)
    assert events == ["a@0"] and gate.in_flight == 1  # the update waits for the running one
    release.set()
    assert await first == 0 and await late == 1
    await upd
    assert events == ["a@0", "update", "b@1"]


async def test_paused_gate_holds_new_requests() -> None:
    gate = VersionGate(2)
    await gate.set_paused(True)

    async def one() -> int:
        async with gate.reading() as v:
            return v

    task = asyncio.create_task(one(), name="gate-test-paused")
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done() and gate.paused
    await gate.set_paused(False)
    assert await task == 2
