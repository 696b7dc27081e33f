"""A recipe whose tasks cannot be set up fails before anything starts (no warm start, no Ray),
in one line naming the task file and the kind: an unknown kind, an env module that is missing,
a task the host refuses, an agent function that does not resolve. An agent function needs no
env of its own: tasks of a kind no env is named after pass with one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl360.envs.task_check import check_tasks
from rl360.recipe import EnvSection

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def echo_tasks(tmp_path: Path) -> Path:
    p = tmp_path / "echo.jsonl"
    p.write_text(json.dumps({"id": "e1", "prompt": "say hi", "kind": "echo", "data": {}}) + "\n")
    return p


@pytest.fixture
def image_task(tmp_path: Path) -> Path:
    """A Harbor task that needs a container image of its own (docker only)."""
    d = tmp_path / "needs-image"
    (d / "tests").mkdir(parents=True)
    (d / "instruction.md").write_text("do it")
    (d / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (d / "task.toml").write_text('[environment]\ndocker_image = "example/image:1"\n')
    return d


def test_unknown_kind_names_the_file_and_the_kind(echo_tasks: Path) -> None:
    with pytest.raises(ValueError) as err:
        check_tasks([str(echo_tasks)], EnvSection())
    msg = str(err.value)
    assert "\n" not in msg and str(echo_tasks) in msg and "kind 'echo'" in msg
    assert "unknown env 'echo'" in msg


def test_missing_env_module_and_agent_function(echo_tasks: Path) -> None:
    with pytest.raises(ValueError, match=r"kind 'echo'.*module 'nopkg.envs' not importable"):
        check_tasks([str(echo_tasks)], EnvSection(env="nopkg.envs:Env"))
    with pytest.raises(ValueError, match=r"env\.agent_fn: .*'nopkg\.agent' not importable"):
        check_tasks([str(echo_tasks)], EnvSection(agent_fn="nopkg.agent:run"))


def test_an_agent_function_needs_no_env(echo_tasks: Path) -> None:
    assert check_tasks([str(echo_tasks)], EnvSection(agent_fn="rl360.envs.agent:run_agent_fn")) == 1


def test_a_refused_task_fails_the_check(image_task: Path) -> None:
    from rl360.envs.sandbox import unavailable_reason

    if unavailable_reason("docker") is None:
        pytest.skip("a Docker engine runs here: the task is not refused")
    with pytest.raises(ValueError) as err:
        check_tasks([str(image_task)], EnvSection())
    assert str(image_task) in str(err.value) and "kind 'harbor'" in str(err.value)
    assert "needs its own container" in str(err.value)


def test_the_agent_worker_runs_harbor_tasks_only() -> None:
    with pytest.raises(ValueError, match=r"code\.jsonl: tasks of kind 'code'.*runs Harbor tasks"):
        check_tasks([str(REPO / "examples/tasks/code.jsonl")],
                    EnvSection(env="agent", params={"command": ["x"]}))
    assert check_tasks([str(REPO / "examples/harbor")],
                       EnvSection(env="agent", params={"command": ["x"]})) >= 2


def test_rl360_train_fails_before_ray_starts(echo_tasks: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "rl360", "train", "recipes/cpu-demo.toml",
           "--set", f"train.tasks=[{json.dumps(str(echo_tasks))}]",
           "--set", f"run.out_dir={json.dumps(str(tmp_path / 'runs'))}"]
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    took = time.monotonic() - t0
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(echo_tasks) in lines[0] and "kind 'echo'" in lines[0], lines
    assert "Ray" not in out.stdout + out.stderr and not (tmp_path / "runs").exists()
    print(f"failed in {took:.1f}s")
