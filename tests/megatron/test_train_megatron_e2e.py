"""`rl360 train --set trainer.backend=megatron` on the tiny policy, in its own process (its own
local Ray), on one rank and as tensor parallel 2: steps complete with finite losses, weights
reach the engine, and the checkpoint is a plain HF model (plus one optimizer slice per TP rank).
The untrained tiny policy earns no reward, so these runs show the plumbing; the trainer tests
show the steps are right."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl360.ray_session import free_port
from tests.megatron.conftest import MEGATRON_MISSING

pytest.importorskip("megatron.core", reason=MEGATRON_MISSING)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_rl360_train_with_the_megatron_backend(tmp_path: Path, tp: int) -> None:
    sets = [
        "run.name=meg", f"run.out_dir={json.dumps(str(tmp_path))}", "model.path='tiny'",
        "train.init=''", "ray.dashboard=false", f"serve.port={free_port()}", "env.actors=1",
        "engine.num_cpus=0.5", "trainer.num_cpus=0.5", "trainer.backend='megatron'",
        "trainer.micro_batch_size=4", "train.steps=3", "train.group_size=2",
        "train.groups_per_batch=2", "train.task_limit=4",
        "train.tasks=['examples/tasks/code.jsonl']", "train.sampling.max_tokens=16",
        "train.checkpoints.every=3", "train.wandb='offline'", "train.max_staleness=1",
        f"trainer.megatron.tensor_parallel={tp}", f"trainer.workers={tp}",
    ]
    args = [sys.executable, "-m", "rl360", "train", "recipes/cpu-demo.toml"]
    for s in sets:
        args += ["--set", s]
    # PYTHONPATH carries megatron-core when `make test-megatron` put it in its own folder;
    # Ray's workers inherit it from this driver
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "WANDB_MODE": "offline", "RAY_ADDRESS": "local"}
    out = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "meg" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert rows[-1]["policy_version"] == 3

    import torch
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "meg" / "checkpoints" / "step_000003" / "model"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert state["backend"] == "megatron" and state["step"] == 3
    assert state["tensor_parallel"] == tp
    assert (ckpt / "trainer_state.tp1.pt").is_file() == (tp == 2)
    AutoModelForCausalLM.from_pretrained(ckpt)  # a plain HF checkpoint
