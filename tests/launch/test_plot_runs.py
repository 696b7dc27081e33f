"""`rl360 plot`: runs on one axis, the first step and time each reached a target."""

from __future__ import annotations

import json
from pathlib import Path

from rl360.cli import main
from rl360.launch.plot_runs import read_curve


def _run(tmp: Path, name: str, rows: list[dict]) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_two_runs_plotted_with_time_to_target(tmp_path: Path, capsys) -> None:
    sync = _run(tmp_path, "sync", [
        {"step": 1, "reward_mean": 0.3, "step_s": 5.0, "elapsed_s": 12.0},
        {"step": 2, "reward_mean": 0.9, "step_s": 5.0, "elapsed_s": 17.0},
    ])
    # a run from before `elapsed_s` existed: time is the running sum of step_s; a row
    # without a reward (an eval-only row) is skipped
    old = _run(tmp_path, "old", [
        {"step": 1, "reward_mean": 0.5, "step_s": 4.0},
        {"step": 2, "reward_mean": None, "step_s": 4.0},
        {"step": 3, "reward_mean": 0.86, "step_s": 4.0},
    ])
    out = tmp_path / "pair.png"
    rc = main(["plot", str(sync), str(old / "metrics.jsonl"), "--labels", "sync,old",
               "--target", "0.85", "--out", str(out)])
    assert rc == 0
    assert out.stat().st_size > 1000
    text = capsys.readouterr().out
    assert "sync: 2 steps, 17 s, best 0.900, first >= 0.85 at step 2 (17 s)" in text
    assert "old: 2 steps, 12 s, best 0.860, first >= 0.85 at step 3 (12 s)" in text
    assert read_curve(old / "metrics.jsonl", "old").first_reaching(0.95) is None


def test_a_missing_run_or_wrong_labels_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "no metrics.jsonl at" in capsys.readouterr().err
    run = _run(tmp_path, "a", [{"step": 1, "reward_mean": 0.1}])
    assert main(["plot", str(run), "--labels", "x,y"]) == 2
    assert "--labels: 2 labels for 1 runs" in capsys.readouterr().err
    (run / "metrics.jsonl").write_text("{not json\n")
    assert main(["plot", str(run)]) == 2
    assert "metrics.jsonl:1: not a JSON line" in capsys.readouterr().err


def test_another_metric_is_drawn_and_reported(tmp_path: Path, capsys) -> None:
    """A run that parks tasks is judged on task_reward_mean (every task once), not on the
    batch's reward_mean, whose task mix moves."""
    parked = _run(tmp_path, "parked", [
        {"step": 1, "reward_mean": 0.9, "task_reward_mean": 0.8, "elapsed_s": 10.0},
        {"step": 2, "reward_mean": 0.95, "task_reward_mean": 0.86, "elapsed_s": 11.0},
    ])
    out = tmp_path / "p.png"
    assert main(["plot", str(parked), "--metric", "task_reward_mean", "--target", "0.85",
                 "--out", str(out)]) == 0
    assert "parked: 2 steps, 11 s, best 0.860, first >= 0.85 at step 2 (11 s)" in \
        capsys.readouterr().out
    assert main(["plot", str(parked), "--metric", "nope", "--out", str(out)]) == 0
    assert "parked: no steps with nope" in capsys.readouterr().out
