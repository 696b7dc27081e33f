"""`rl360 train` with the agent worker: an agent program people already run, unmodified, is the
tiny policy's harness on the example Harbor tasks, for 5 steps: mini-swe-agent from PyPI
(recipes/cpu-mini-swe-agent.toml) and an OpenAI-SDK script (recipes/cpu-openai-agent.toml,
examples/agents/). Every step logs what a step of the built-in loop logs, every episode is
scored (no infrastructure failure), and the ledger's re-render check finds none of the
differences that must stay 0."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl360.weights.transports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 5


def train(recipe: str, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "rl360", "train", recipe]
    for s in (f"run.out_dir={json.dumps(str(out))}", "run.name='agent'", f"serve.port={free_port()}",
              f"train.steps={STEPS}", "train.groups_per_batch=1", "train.checkpoints.every=0",
              "train.wandb='offline'"):
        cmd += ["--set", s]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "WANDB_MODE": "offline"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=850)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "agent" / "metrics.jsonl").open()]
    return [r for r in rows if "reward_mean" in r]


def check_steps(rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["episodes"] >= 1 and r["infra_rate"] == 0.0, r
        assert {"pass_rate", "loss", "train_tokens_per_s"} <= set(r) and r["groups/total"] >= 1, sorted(r)
        assert any(k.startswith("domain/harbor/") for k in r), sorted(r)
        for phase in ("sandbox_start_s", "setup_s", "rollout_s", "verify_s", "episode_s"):
            assert f"time/episode/{phase}" in r, sorted(r)
        assert r["tito/rerender_checked"] >= 1, sorted(r)
        for kind in ("special_token_count", "special_token_type", "non_assistant_text", "error"):
            assert r[f"tito/{kind}"] == 0, r


@pytest.mark.skipif(importlib.util.find_spec("minisweagent") is None,
                    reason="mini-swe-agent is in the `agents` extra")
def test_train_with_mini_swe_agent(tmp_path: Path) -> None:
    check_steps(train("recipes/cpu-mini-swe-agent.toml", tmp_path))


def test_train_with_an_openai_sdk_agent(tmp_path: Path) -> None:
    check_steps(train("recipes/cpu-openai-agent.toml", tmp_path))
