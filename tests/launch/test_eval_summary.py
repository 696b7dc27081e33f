"""rl360 eval's table: pass@k, infra failures kept out of the scores, calibration band."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl360.launch.eval_run import pass_at_k, summarize, write_calibration
from rl360.recipe import decode_recipe
from rl360.types import Reward, Task, Trajectory


def traj(task: str, reward: float | None, status: str = "ok") -> Trajectory:
    return Trajectory(session_id="s", tokens=[], mask=[], logprobs=[], versions=[], provenance=[],
                      task_id=task, status=status,  # type: ignore[arg-type]
                      reward=None if reward is None else Reward(reward, {"all_pass": float(reward == 1.0)}))


def test_pass_at_k_unbiased_estimator() -> None:
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)


def test_infra_errors_are_counted_not_scored() -> None:
    trajs = [traj("a", 1.0), traj("a", 0.0), traj("a", None, "infra_error"), traj("b", 0.5)]
    s = summarize(trajs, k=2)
    a = next(r for r in s["rows"] if r["task"] == "a")
    assert a["n"] == 2 and a["infra_errors"] == 1 and a["mean_reward"] == 0.5 and a["pass@1"] == 0.5
    assert s["overall"]["infra_errors"] == 1


def test_calibration_keeps_tasks_inside_the_band(tmp_path: Path) -> None:
    recipe = decode_recipe({"eval": {"band": [0.2, 0.6], "attempts": 4}})
    trajs = [traj("never", 0.0)] * 4 + [traj("half", 1.0), traj("half", 0.0)] * 2 + [traj("always", 1.0)] * 4
    tasks = [Task(id=i, prompt="") for i in ("never", "half", "always")]
    write_calibration(summarize(trajs, 4), tasks, recipe, tmp_path)
    kept = [json.loads(x)["id"] for x in (tmp_path / "calibrated_tasks.jsonl").open()]
    assert kept == ["half"]
    rates = json.loads((tmp_path / "calibration.json").read_text())["pass_rates"]
    assert rates == {"always": 1.0, "half": 0.5, "never": 0.0}
