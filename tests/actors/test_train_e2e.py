"""`rl360 train` end to end on a tiny model in its own process (its own local Ray): metrics,
an HF checkpoint that transformers loads, and a resume after `kill -9` of the driver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl360.actors.run_ledger import account, read_ledger
from rl360.ray_session import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
PORT = free_port()


def train_cmd(out: Path, steps: int, *extra: str) -> list[str]:
    # the run makes its warm start first (rl360 sft), a small one in the test's own dir: the
    # demo's 400 steps x 64 chats took 11 min on a 2-core CI box (the test's budget is 10)
    warm = json.dumps(str(out / "warm"))
    sets = [
        f"sft.out={warm}", f"train.init={warm}", "sft.steps=30", "sft.samples=2000",
        "run.name=e2e", f"run.out_dir={json.dumps(str(out))}", "model.path='tiny'",
        "ray.dashboard=false", f"serve.port={PORT}", "env.actors=1", "engine.num_cpus=0.5",
        "trainer.num_cpus=0.5", f"train.steps={steps}", "train.group_size=2",
        "train.groups_per_batch=2", "train.task_limit=4", "train.tasks=['examples/tasks/code.jsonl']",
        "train.sampling.max_tokens=16", "train.checkpoints.every=1", "train.wandb='offline'",
        "train.max_staleness=1",
    ]
    args = [sys.executable, "-m", "rl360", "train", "recipes/cpu-demo.toml", *extra]
    for s in sets:
        args += ["--set", s]
    return args


def rows(out: Path) -> list[dict]:
    p = out / "e2e" / "metrics.jsonl"
    return [json.loads(line) for line in p.open()] if p.exists() else []


def test_train_checkpoint_kill_and_resume(tmp_path: Path) -> None:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "WANDB_MODE": "offline"}
    proc = subprocess.Popen(train_cmd(tmp_path, 6), cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600  # the warm start (SFT) comes first
    while len(rows(tmp_path)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert len(rows(tmp_path)) >= 2, proc.stdout.read() if proc.poll() is not None else "too slow"
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started, by our own pid
    proc.wait()
    ckpts = sorted((tmp_path / "e2e" / "checkpoints").glob("step_*"))
    assert ckpts, "no checkpoint before the kill"
    last = json.loads((ckpts[-1] / "rl360_checkpoint.json").read_text())
    assert last["step"] >= 1 and last["version"] == last["step"]

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpts[-1] / "model")  # a plain HF checkpoint

    # checkpoints.keep=1: the checkpoint we resume from is rotated away at the first save, and
    # later saves must not need it (they once copied tokenizer files from it)
    resume = [*train_cmd(tmp_path, 6, "--resume"), "--set", "train.checkpoints.keep=1"]
    out = subprocess.run(resume, cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"resumed from {ckpts[-1]}" in out.stderr
    steps = [r["step"] for r in rows(tmp_path)]
    assert steps[-1] == 6 and sorted(set(steps)) == list(range(1, 7))
    final = rows(tmp_path)[-1]
    assert final["policy_version"] == 6 and final["staleness_max"] <= 1
    # the ledger over both runs (the killed one up to the checkpoint resumed from): no task
    # occurrence skipped, none trained twice; the tasks in flight at the kill ran again
    acc = account(read_ledger(tmp_path / "e2e" / "ledger.jsonl"), 2)
    print(f"fault driver kill -9 + --resume: occurrences {acc['occurrences']}, lost "
          f"{acc['lost']}, duplicated {acc['duplicated']}, episodes re-run "
          f"{acc['episodes_rerun']}, episodes lost {acc['episodes_lost']}")
    assert acc["occurrences"] > 0 and acc["lost"] == 0 and acc["duplicated"] == 0, acc
    assert (tmp_path / "e2e" / "reward_curve.png").stat().st_size > 1000

    # a time budget that runs out while the run waits for a batch ends it there, exit 0, with
    # nothing lost: the newest checkpoint is still the resumed one (the budget is checked while
    # waiting, so a run whose rollouts hang still ends)
    budget = [*train_cmd(tmp_path, 50, "--resume"), "--set", "train.max_minutes=0.001"]
    out = subprocess.run(budget, cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "time budget of 0.001 min reached while waiting for the batch of step 7" in out.stdout
    assert [r["step"] for r in rows(tmp_path)][-1] == 6
    assert sorted(p.name for p in (tmp_path / "e2e" / "checkpoints").glob("step_*"))[-1] == "step_000006"


def test_train_logs_domains_components_trajectories_and_eval(tmp_path: Path) -> None:
    """Reward logging: a 3-step run (no warm start) writes per-domain, per-component and
    group metrics every step, N trajectories per step, and eval/* from the held-out set."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "WANDB_MODE": "offline"}
    cmd = train_cmd(tmp_path, 3)
    for s in ("train.init=''", "train.log_trajectories=2", "train.eval_every=1",
              "eval.tasks=['examples/tasks/code.jsonl']", "eval.limit=2"):
        cmd += ["--set", s]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=550)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = rows(tmp_path)
    steps = [r for r in got if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # a step logs the episodes of the batch it trained (plus the groups filtered out before
    # it was cut), so every step has some, even when an async head start finished them all
    # before step 1; `episodes_finished` is the generation stream
    assert all(r["episodes"] for r in steps) and sum(r["episodes"] for r in steps) >= 2 * 2 * 3
    assert sum(r["episodes_finished"] for r in steps) >= 2 * 2 * 3
    for r in steps:
        domains = {k.split("/")[1] for k in r if k.startswith("domain/")}
        assert domains and domains <= {"add_k", "sub_k"}, r  # task_limit=4: the tasks' families
        d = sorted(domains)[0]
        for k in ("reward_mean", "pass_rate", "infra_rate", "episodes", "loss_tokens"):
            assert f"domain/{d}/{k}" in r, (k, sorted(r))
        assert any(k.startswith("task/") for k in r)
        assert any(k.startswith("component/") and k.endswith("/mean") for k in r), sorted(r)
        assert r["groups/total"] >= 1 and "groups/zero_variance" in r and "masked/infra" in r
        # the ledger's re-render check of every trained sample (TITO invariant 7): the
        # severe kinds stay 0
        assert r["tito/rerender_checked"] >= 1, sorted(r)
        assert r["tito/special_token_count"] == r["tito/special_token_type"] == 0, r
        assert r["tito/non_assistant_text"] == 0 and r["tito/error"] == 0, r
    deltas = [v for k, v in steps[0].items() if k.endswith("/reward_delta")]
    assert deltas and all(v == 0.0 for v in deltas)  # step 1 is every domain's baseline
    evals = [r for r in got if "eval/reward_mean" in r]
    assert evals and "eval/pass@1" in evals[0] and evals[0]["eval/episodes"] == 2
    trajs = [json.loads(line) for line in (tmp_path / "e2e" / "trajectories.jsonl").open()]
    assert [t["step"] for t in trajs] == [1, 1, 2, 2, 3, 3]
    assert all(t["text"] and "reward" in t and "components" in t and t["versions"]["counts"]
               for t in trajs)
    wandb_files = list((tmp_path / "e2e" / "wandb").rglob("*.wandb"))
    assert wandb_files, "no offline wandb run"


def test_async_path_matches_the_sampler_when_the_policy_does_not_move(tmp_path: Path) -> None:
    """The controlled experiment of the off-policy path: with staleness allowed
    (max_staleness = 2, in-flight weight swaps) but a learning rate too small to change a
    float32 weight, every version is the same policy, so the asynchronous path must train on
    exactly what the sampler saw: stale tokens present, and still no sampler-trainer mismatch,
    full effective sample size, nothing clipped or truncated. A data-path bug (a logprob or a
    version attached to the wrong token, a swap that tears a sequence, a group mixed across
    versions) shows here as mismatch that staleness alone cannot cause."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "WANDB_MODE": "offline"}
    cmd = train_cmd(tmp_path, 5)
    for s in ("train.init=''", "train.max_staleness=2", "train.max_in_flight_groups=6",
              "trainer.lr=1e-12", "trainer.warmup_steps=0", "train.checkpoints.every=0",
              "engine.weight_update='inflight'",
              # every sample through the loss (an untrained policy's groups all score 0: with
              # zero advantages they would be skipped, and their mismatch never measured)
              "trainer.loss.entropy_coef=1e-9"):
        cmd += ["--set", s]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=550)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = [r for r in rows(tmp_path) if r.get("samples")]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert max(r["staleness_max"] for r in steps) >= 1, "no stale token: the test proves nothing"
    for r in steps:
        assert r["tis_mismatch"] < 1e-4, r
        assert r["is_ess_frac"] > 0.9999 and r["sampler_kl"] < 1e-6, r
        assert r["clip_frac"] == 0.0 and r["tis_capped_frac"] == 0.0, r
