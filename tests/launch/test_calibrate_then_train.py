"""`rl360 eval --calibrate` output trains: a scripted engine solves some demo tasks and not
others, calibration keeps the ones in the band, and `rl360 train` runs a step on that file as
its train.tasks (tiny model, scripted engine: cheap and deterministic)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import free_ports

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
SOLVED = {"add_three": "def add_three(x):\n    return x + 3",
          "add_seven": "def add_seven(x):\n    return x + 7"}


def _run(cmd: str, recipe: Path, out: Path, port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "rl360", cmd, str(recipe), "--set", f"serve.port={port}",
            "--set", f"run.out_dir={json.dumps(str(out))}", *extra]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "WANDB_MODE": "offline", "RAY_ADDRESS": ""}
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=800)


def test_calibrated_task_file_is_a_train_task_file(tmp_path: Path) -> None:
    rules = [[f"Write a Python function {name}\\(", f"```python\n{code}\n```"]
             for name, code in SOLVED.items()]
    recipe = tmp_path / "r.toml"
    recipe.write_text(f"""
[run]
name = "cal"
[ray]
num_cpus = 2
dashboard = false
[model]
path = "tiny"
[engine]
backend = "scripted"
num_cpus = 0.5
options = {{ default = "I do not know.", rules = {json.dumps(rules)} }}
[env]
actors = 1
sandbox = "process"
[eval]
tasks = ["examples/tasks/code.jsonl"]
limit = 6
attempts = 2
band_low = 1.0
band_high = 1.0
[trainer]
num_cpus = 0.5
[train]
steps = 1
group_size = 2
groups_per_batch = 1
checkpoints = {{every = 0}}
wandb = "disabled"
""")
    port = free_ports(1)[0]
    ev = _run("eval", recipe, tmp_path, port, "--calibrate")
    assert ev.returncode == 0, ev.stdout[-2000:] + ev.stderr[-3000:]
    cal = tmp_path / "cal" / "calibrated_tasks.jsonl"
    records = [json.loads(line) for line in cal.open()]
    assert sorted(r["id"].split("-")[-1] for r in records) == sorted(SOLVED)
    assert all(r["kind"] == "code" and r["data"]["tests"] for r in records)
    report = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert len(report["rates"]) == 6 and report["kept"] == 2
    tr = _run("train", recipe, tmp_path, port, "--set", f"train.tasks=[{json.dumps(str(cal))}]")
    assert tr.returncode == 0, tr.stdout[-2000:] + tr.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "cal" / "metrics.jsonl").open()]
    assert rows and rows[-1]["step"] == 1
