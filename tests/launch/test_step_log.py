"""The train driver's extra logs: the sampled trajectory rows, eval/* metrics of finished
evaluation episodes, the held-out task set check, and the per-domain lines of the curve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl360.actors.buffer import Member, RefBatch
from rl360.actors.metrics import domain_lines, plot_curve
from rl360.launch.step_log import TrajectoryLog, eval_metrics, load_eval_tasks, trajectory_row
from rl360.types import EpisodeRecord, Reward, Trajectory

REPO = Path(__file__).resolve().parents[2]


def traj(reward: float = 1.0) -> Trajectory:
    return Trajectory(
        session_id="s", tokens=[10, 11, 20, 21, 12, 22], mask=[0, 0, 1, 1, 0, 1],
        logprobs=[None, None, -0.1, -0.2, None, -0.3], versions=[None, None, 3, 3, None, 4],
        provenance=["prompt", "prompt", "generated", "generated", "delta", "generated"],
        task_id="t", group_id="g", domain="math", reward=Reward(reward, {"all_pass": reward}),
        turns=2)


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def test_trajectory_row_decodes_spans_and_summarises_versions() -> None:
    row = trajectory_row(traj(), step=7, advantage=0.5, policy_version=5, decode=decode)
    assert row["text"] == "10 11 20 21 12 22"
    assert row["generated"] == ["20 21", "22"]  # one entry per generated span
    assert row["versions"] == {"min": 3, "max": 4, "counts": {"3": 2, "4": 1}, "staleness_max": 2}
    assert (row["reward"], row["components"], row["advantage"]) == (1.0, {"all_pass": 1.0}, 0.5)
    assert (row["step"], row["domain"], row["loss_tokens"], row["turns"]) == (7, "math", 3, 2)
    json.dumps(row)


def test_trajectory_log_writes_n_per_step(tmp_path: Path) -> None:
    log = TrajectoryLog(tmp_path / "trajectories.jsonl", 2, "unused", seed=0)
    log._decode = decode  # type: ignore[method-assign]  # no tokenizer needed here
    members = [Member(ref=traj(float(i % 2)), advantage=0.0, reward=0.0, tokens=6, loss_tokens=3)
               for i in range(5)]
    assert log.write(RefBatch(members=members, policy_version=4), step=1) == 2
    assert log.write(RefBatch(members=members[:1], policy_version=5), step=2) == 1
    rows = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 1, 2]
    assert TrajectoryLog(tmp_path / "none.jsonl", 0, "", 0).write(RefBatch(members), 1) == 0


def test_eval_metrics_pass_at_1_per_domain() -> None:
    recs = [EpisodeRecord(task_id=f"t{i}", group_id=f"eval-3-{i}", status="ok", domain=d,
                          reward=Reward(v, {"all_pass": v}), loss_tokens=2, min_version=3,
                          max_version=4)
            for i, (d, v) in enumerate([("a", 1.0), ("a", 0.0), ("b", 1.0)])]
    recs.append(EpisodeRecord(task_id="t9", group_id="eval-3-9", status="infra_error",
                              reward=None, domain="b"))
    m = eval_metrics(recs)
    assert m["eval/reward_mean"] == pytest.approx(2 / 3)
    assert m["eval/pass@1"] == pytest.approx(2 / 3)
    assert m["eval/infra_rate"] == pytest.approx(0.25)
    assert m["eval/domain/a/pass@1"] == pytest.approx(0.5) and m["eval/domain/b/pass@1"] == 1.0
    assert m["eval/policy_version_min"] == 3 and m["eval/policy_version_max"] == 4
    assert not any(k.startswith("eval/task/") for k in m)


def test_eval_tasks_are_checked_up_front(tmp_path: Path) -> None:
    assert load_eval_tasks(["nowhere"], 0, every=0) == []  # off: not even read
    tasks = load_eval_tasks([str(REPO / "examples/tasks/code.jsonl")], 3, every=2)
    assert len(tasks) == 3 and tasks[0].data["domain"]
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"train\.eval_every = 2 needs held-out tasks"):
        load_eval_tasks([str(tmp_path / "empty.jsonl")], 0, every=2)
    with pytest.raises(ValueError, match=r"train\.eval_every: eval\.tasks"):
        load_eval_tasks([str(tmp_path / "missing")], 0, every=2)


def test_curve_has_one_line_per_domain(tmp_path: Path) -> None:
    rows = [{"step": s, "reward_mean": 0.1 * s, "domain/a/reward_mean": 0.1 * s,
             "domain/b/reward_mean": 0.2, "eval/reward_mean": 0.3} for s in (1, 2, 3)]
    rows[1]["domain/b/reward_mean"] = float("nan")
    lines = domain_lines(rows)
    assert list(lines) == ["a", "b"] and len(lines["a"]) == 3 and len(lines["b"]) == 2
    out = plot_curve(rows, tmp_path / "curve.png")
    assert out is not None and out.stat().st_size > 1000
