"""rl360 eval's table: pass@k, infra failures kept out of the scores, calibration band."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl360.launch.eval_run import format_table, pass_at_k, summarize, write_calibration
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
    assert a["infra_rate"] == pytest.approx(1 / 3)  # reported next to pass@k, per task
    assert "infra%" in format_table(s, 2) and "33.3%" in format_table(s, 2)


def test_calibration_keeps_tasks_inside_the_band(tmp_path: Path) -> None:
    recipe = decode_recipe({"eval": {"band_low": 0.2, "band_high": 0.6, "attempts": 4}})
    trajs = ([traj("never", 0.0)] * 4 + [traj("half", 1.0), traj("half", 0.0)] * 2
             + [traj("always", 1.0)] * 4 + [traj("broken", None, "infra_error")] * 4)
    tasks = [Task(id="never", prompt="p", data={"tests": ["assert True"]}),
             Task(id="half", prompt="solve", data={"tests": ["assert f() == 1"], "family": "f"}),
             Task(id="always", prompt="p", kind="tools", data={"answer": "a"}),
             Task(id="broken", prompt="p", kind="harbor", data={"path": "/x"})]
    out = write_calibration(summarize(trajs, 4), tasks, recipe, tmp_path)
    assert out == tmp_path / "calibrated_tasks.jsonl"
    report = json.loads((tmp_path / "calibration.json").read_text())
    rates = {r["task"]: (r["pass_rate"], r["kept"]) for r in report["rates"]}
    assert rates == {"never": (0.0, False), "half": (0.5, True), "always": (1.0, False),
                     "broken": (None, False)}  # every task's rate, infra-only ones without
    assert report["band"] == [0.2, 0.6] and report["attempts"] == 4


def test_calibrated_file_holds_full_records_that_load_as_tasks(tmp_path: Path) -> None:
    from rl360.envs.tasks import iter_tasks

    recipe = decode_recipe({"eval": {"band_low": 0.0, "band_high": 1.0, "attempts": 2,
                                     "calibrated_out": str(tmp_path / "sub" / "cal.jsonl")}})
    tasks = [Task(id="c", prompt="write f", data={"tests": ["assert f() == 1"], "entry_point": "f"}),
             Task(id="t", prompt="q?", kind="tools", data={"answer": "KeyError", "tools": ["search"]}),
             Task(id="h", prompt="do it", kind="harbor", data={"path": "/abs/task", "workdir": "/app"})]
    trajs = [traj(t.id, v) for t in tasks for v in (1.0, 0.0)]
    out = write_calibration(summarize(trajs, 2), tasks, recipe, tmp_path)
    assert out == tmp_path / "sub" / "cal.jsonl"
    loaded = list(iter_tasks(out))  # the same Tasks, every kind, read by train.tasks' loader
    assert all(t.data.pop("domain") == "sub" for t in loaded)  # the loader adds the file's dir
    assert loaded == tasks


def test_default_band_is_the_seed_s_and_both_ends_are_keys() -> None:
    e = decode_recipe({}).eval
    assert (e.band_low, e.band_high) == (0.2, 0.4)
    with pytest.raises(Exception, match=r"eval: band_low \(0\.5\) must be <= band_high"):
        decode_recipe({"eval": {"band_low": 0.5, "band_high": 0.3}})


def test_calibration_by_domain_keeps_every_task_of_a_family_inside_the_band(
        tmp_path: Path) -> None:
    """Few attempts per task cannot place a task, a family's pooled attempts can: with
    calibrate_by = "domain" every task of eval.tasks whose family's rate is in the band goes to
    the file, also those per_domain left out of the calibration run."""
    from rl360.launch.eval_run import load_tasks

    src = tmp_path / "tasks.jsonl"
    src.write_text("".join(json.dumps({"id": f"{fam}-{i}", "prompt": "p", "family": fam,
                                       "tests": ["assert True"]}) + "\n"
                           for fam in ("easy", "some", "none") for i in range(5)))
    recipe = decode_recipe({"eval": {"tasks": [str(src)], "band_low": 0.1, "band_high": 0.9,
                                     "attempts": 2, "per_domain": 2, "calibrate_by": "domain"}})
    tasks = load_tasks(recipe)
    assert [t.id for t in tasks] == ["easy-0", "easy-1", "some-0", "some-1", "none-0", "none-1"]
    outcome = {"easy": (1.0, 1.0), "some": (1.0, 0.0), "none": (0.0, 0.0)}
    trajs = [traj(t.id, v) for t in tasks for v in outcome[t.data["domain"]]]
    out = write_calibration(summarize(trajs, 2), tasks, recipe, tmp_path)
    from rl360.envs.tasks import iter_tasks

    assert [t.id for t in iter_tasks(out)] == [f"some-{i}" for i in range(5)]
    report = json.loads((tmp_path / "calibration.json").read_text())
    assert report["kept_domains"] == ["some"] and report["domains"]["easy"] == 1.0
