"""End to end: mini-swe-agent from PyPI, unmodified, on a Harbor task through the env actors,
the session server and an engine. Every model call lands in the episode's one session, the
trajectory is the session's ledger (it re-renders exactly) and the Harbor verifier scores it.
Against the scripted engine, whose replies are the right commands, the reward is 1; against
the torch engine with a tiny untrained policy any outcome is fine but it must be scored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.serving import SERVE_PORT

pytest.importorskip("minisweagent", reason="mini-swe-agent is in the `agents` extra")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
TASK = REPO / "examples/harbor/count-ok-rows"

SOLVE = ("cd /app && python3 -c \"import csv; print(sum(1 for r in csv.DictReader(open("
         "'jobs.csv')) if r['status'] == 'ok' and int(r['seconds']) < 60))\" > count.txt")


def call(command: str) -> str:
    args = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"Running it.\n<tool_call>\n{args}\n</tool_call>"


# the scripted policy: the solving command first, then mini-swe-agent's own way to finish
RULES = [["</tool_response>", call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]]
# mini-swe-agent's own config, shortened for a byte-level tiny model's 2048-token context
SHORT = ["-c", "agent.instance_template={{task}} Run one bash command per reply; when done "
         "run: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "-c", "agent.step_limit=4"]


def run_episodes(overrides: list[str], options: dict[str, Any] | None, n: int = 1,
                 max_tokens: int = 256) -> list[Any]:
    import msgspec
    import ray

    from rl360.actors.env_pool import EnvPool
    from rl360.envs.tasks import load_harbor_task
    from rl360.launch.serve_app import start_serving, stop_serving
    from rl360.recipe import apply_overrides, decode_recipe

    data = apply_overrides({}, [
        "ray.namespace='rl360-tests'", "engine.num_cpus=0.25", f"serve.port={SERVE_PORT}",
        "env.num_cpus=0", "env.env='agent'", f"train.sampling.max_tokens={max_tokens}",
        "serve.app_name='rl360-agent-worker'", *overrides])
    if options:
        data["engine"]["options"] = options
    data["env"]["params"] = {"agent": "mini-swe-agent", "args": SHORT}
    recipe = decode_recipe(data)
    serving = start_serving(recipe)
    pool = None
    try:
        pool = EnvPool(recipe.env, msgspec.to_builtins(recipe.train.sampling),
                       serving.shard_names, serving.namespace, serving.base_url)
        task = load_harbor_task(TASK)
        return ray.get([pool.submit(task, f"g{i}") for i in range(n)], timeout=400)
    finally:
        if pool is not None:
            pool.shutdown()
        stop_serving(serving)


def generations(traj: Any) -> int:
    """The distinct generations in the trajectory's picked samples (each a run of mask-1
    tokens, told apart by its path: samples that share a prefix share its generations)."""
    seen = set()
    for s in [traj, *traj.branches]:
        for i, m in enumerate(s.mask):
            if m and (i + 1 == len(s.mask) or not s.mask[i + 1]):
                seen.add(tuple(s.tokens[: i + 1]))
    return len(seen)


def assert_one_session(traj: Any, exact: bool) -> None:
    """Every model call the agent got an answer to is a generation of this one session; the
    ledger's re-render check of every picked sample finds no difference (`exact`), or none
    of the kinds that must stay 0 (TITO invariant 7: the special tokens and the prompt text;
    a random byte-level policy writes bytes that are no UTF-8 and cannot re-render as such)."""
    calls = traj.counters["agent_model_calls"]
    assert calls >= 1 and generations(traj) == calls, (generations(traj), traj.counters)
    for s in [traj, *traj.branches]:
        assert sum(s.mask) > 0 and len(s.tokens) == len(s.mask) == len(s.logprobs)
    counts = traj.record().rerender
    assert counts["checked"] == 1 + len(traj.branches)
    if exact:
        assert counts.get("mismatch", 0) == 0, counts
    for kind in ("special_token_count", "special_token_type", "non_assistant_text", "error"):
        assert counts.get(kind, 0) == 0, counts
    assert traj.counters["agent_refused_requests"] == 0


def test_mini_swe_agent_solves_with_the_scripted_policy(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    traj, = run_episodes(["engine.backend='scripted'"], {"rules": RULES, "default": call(SOLVE)})
    assert traj.status == "ok", traj.error
    assert traj.reward is not None and traj.reward.value == 1.0, traj.reward
    assert_one_session(traj, exact=True)
    assert traj.counters["agent_model_calls"] == 2 and traj.turns == 2 and not traj.branches
    # the commands it ran are the policy's: they are in the ledger as generated tokens
    from rl360.policies.loading import load_tokenizer

    text = load_tokenizer("tiny").decode(
        [t for t, m in zip(traj.tokens, traj.mask, strict=True) if m])
    assert "csv.DictReader" in text and "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in text


@pytest.mark.slow
def test_mini_swe_agent_on_the_torch_engine_is_scored(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    traj, = run_episodes(["engine.backend='torch'", "model.path='tiny'"], None, max_tokens=48)
    # a tiny untrained policy: whatever it does is the agent's outcome, scored
    assert traj.status in ("ok", "error", "timeout", "truncated"), traj.error
    assert traj.reward is not None, traj.error
    assert_one_session(traj, exact=False)

