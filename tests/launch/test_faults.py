"""Fault drills (docs/faults.md): a short `rl360 train` on the tiny model (its own process, its own local
Ray) loses one part right after step 1 (`train.inject_faults`): an env actor, an engine
replica, a session shard, the weight publisher. The run must finish its steps, and its ledger
(<run dir>/ledger.jsonl, rl360.actors.run_ledger) must show no task occurrence lost and none
trained twice; episodes re-run are allowed and reported. With the sharded collective weight
sync (2 fsdp ranks, 2 engine replicas), a killed replica and a stalled one: the run keeps
training, the stalled one is named in one line within the sync's timeout and replaced, and the
replacement rejoins the groups and takes the newest version. A run whose every sandbox fails to
start ends with the circuit breaker's one line instead of hanging. (The driver's `kill -9` and
`--resume` drill is tests/actors/test_train_e2e.py, which checks the same ledger.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl360.actors.run_ledger import account, read_ledger
from rl360.ray_session import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
GROUP_SIZE = 2


def fault_cmd(out: Path, steps: int, *sets: str) -> list[str]:
    base = [
        "run.name=faults", f"run.out_dir={json.dumps(str(out))}", "model.path='tiny'",
        "ray.dashboard=false", f"serve.port={free_port()}", "env.actors=2",
        "engine.num_cpus=0.5", "trainer.num_cpus=0.5", f"train.steps={steps}",
        f"train.group_size={GROUP_SIZE}", "train.groups_per_batch=2", "train.task_limit=4",
        "train.tasks=['examples/tasks/code.jsonl']", "train.sampling.max_tokens=16",
        "train.checkpoints.every=1", "train.wandb='disabled'", "train.max_staleness=1",
        "train.init=''", "train.max_in_flight_groups=4", *sets,
    ]
    args = [sys.executable, "-m", "rl360", "train", "recipes/cpu-demo.toml"]
    for s in base:
        args += ["--set", s]
    return args


def run_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
            "WANDB_MODE": "offline", **extra}


def metrics(out: Path) -> list[dict]:
    p = out / "faults" / "metrics.jsonl"
    return [json.loads(line) for line in p.open()] if p.exists() else []


@pytest.mark.parametrize("part", ["env_actor", "engine", "shard", "publisher"])
def test_a_killed_part_loses_no_task(tmp_path: Path, part: str) -> None:
    steps = 4
    cmd = fault_cmd(tmp_path, steps, f"train.inject_faults=['{part}@1']")
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True,
                         timeout=540)
    took = time.monotonic() - t0
    log = out.stdout[-3000:] + out.stderr[-4000:]
    assert out.returncode == 0, log
    assert "fault drill: killed" in out.stderr and f"({part}) after step 1" in out.stderr, log
    assert [r["step"] for r in metrics(tmp_path) if "reward_mean" in r][-1] == steps
    acc = account(read_ledger(tmp_path / "faults" / "ledger.jsonl"), GROUP_SIZE)
    print(f"fault {part}: {took:.0f}s, occurrences {acc['occurrences']}, lost {acc['lost']}, "
          f"duplicated {acc['duplicated']}, episodes re-run {acc['episodes_rerun']}, "
          f"episodes lost {acc['episodes_lost']}")
    assert [f["part"] for f in acc["faults"]] == [part]
    assert acc["occurrences"] > 0 and acc["settled"] > 0
    assert acc["lost"] == 0, acc
    assert acc["duplicated"] == 0, acc
    # the failures were transient: every episode they cut was re-run to a scored result, so
    # every group kept group_size samples
    assert acc["episodes_lost"] == 0, acc


# the sharded collective weight sync between 2 fsdp ranks and 2 engine replicas
COLLECTIVE = ["engine.replicas=2", "engine.num_cpus=0.25", "trainer.backend='fsdp'",
              "trainer.workers=2", "trainer.num_cpus=0.25",
              "train.weight_sync={transport='collective', sharded=true, bucket_mb=0.05, "
              "timeout_min_s=8.0, timeout_factor=2.0}"]


@pytest.mark.parametrize("part", ["engine", "engine_stall"])
def test_collective_sync_heals_around_a_lost_replica(tmp_path: Path, part: str) -> None:
    steps, at = 8, 2
    cmd = fault_cmd(tmp_path, steps, f"train.inject_faults=['{part}@{at}']", *COLLECTIVE)
    out = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True,
                         timeout=570)
    log = out.stdout[-3000:] + out.stderr[-5000:]
    assert out.returncode == 0, log
    rows = [r for r in metrics(tmp_path) if "reward_mean" in r]
    assert rows[-1]["step"] == steps, log
    acc = account(read_ledger(tmp_path / "faults" / "ledger.jsonl"), GROUP_SIZE)
    print(f"collective {part}: lost {acc['lost']}, duplicated {acc['duplicated']}, episodes "
          f"re-run {acc['episodes_rerun']}, episodes lost {acc['episodes_lost']}")
    assert [f["part"] for f in acc["faults"]] == [part]
    assert acc["lost"] == 0 and acc["duplicated"] == 0 and acc["episodes_lost"] == 0, acc
    synced = [r for r in rows if "sync_epoch" in r]
    assert synced[0]["sync_replicas"] == 2 and synced[0]["sync_epoch"] == 1
    # the replacement joined a new epoch and took the newest version with the other replica
    # (one new epoch when Serve's replacement registered before the next sync, else one
    # without the lost replica and one more with its replacement)
    later = [r for r in synced if r["step"] > at]
    assert later and later[-1]["sync_replicas"] == 2 and later[-1]["sync_epoch"] >= 2, synced
    lines = [x for x in out.stderr.splitlines() if "did not take version" in x]
    if part == "engine":
        assert not lines, lines  # a dead replica is let go, not waited for
        return
    # the stall: one line naming the replica and the version, within the sync's timeout
    assert len(lines) == 1, log
    m = re.search(r"replica (\S+) did not take version (\d+) within ([\d.]+)s", lines[0])
    assert m and int(m.group(2)) == at and "replacing it" in lines[0], lines[0]
    stalled = next(r for r in rows if r["step"] == at)
    assert float(m.group(3)) >= 8.0 and stalled["sync_s"] <= float(m.group(3)) + 30, stalled


FAKE_BWRAP = """#!/bin/sh
# the host's bwrap for the availability probe (its last argument is /bin/true); every real
# sandbox start fails the way an unprivileged container makes it fail
for last; do :; done
if [ "$last" = "/bin/true" ]; then exec {real} "$@"; fi
echo "bwrap: setting up uid map: Permission denied" >&2
exit 1
"""


def test_every_sandbox_failing_trips_the_breaker(tmp_path: Path) -> None:
    import shutil

    real = shutil.which("bwrap")
    if real is None:
        pytest.skip("bubblewrap is not installed: sandbox 'auto' refuses to run at all")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "bwrap").write_text(FAKE_BWRAP.format(real=real))
    (bin_dir / "bwrap").chmod(0o755)
    cmd = fault_cmd(tmp_path, 50, "train.breaker.groups=2")
    env = run_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    log = out.stdout[-3000:] + out.stderr[-4000:]
    assert out.returncode == 1, log
    lines = [x for x in out.stderr.splitlines() if x.startswith("rl360: circuit breaker:")]
    assert len(lines) == 1, log
    assert "groups in a row failed on the infrastructure" in lines[0]
    assert "sandbox" in lines[0].lower() and "SandboxStartError" in lines[0], lines[0]
    assert not metrics(tmp_path) or all(r.get("step", 0) < 50 for r in metrics(tmp_path))
