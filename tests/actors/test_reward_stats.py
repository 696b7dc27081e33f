"""What a step logs about its episodes: per domain, task and component; group outcomes; masked
episodes; deltas against a domain's first step (pure functions, and the buffer's stats)."""

from __future__ import annotations

import math

import pytest

from rl360.actors.buffer import TrajectoryBuffer
from rl360.actors.reward_stats import (
    episode_metrics,
    first_values,
    group_metrics,
    group_outcome,
    masked_metrics,
    task_domain,
    timing_metrics,
    with_deltas,
)
from rl360.envs.tasks import with_domain
from rl360.recipe import TrainSection, checked
from rl360.types import EpisodeRecord, Reward, Task, Trajectory


def rec(reward: float | None, domain: str = "math", task: str = "t1", status: str = "ok",
        tokens: int = 10, loss_tokens: int = 4, **comps: float) -> EpisodeRecord:
    return EpisodeRecord(task_id=task, group_id="g", status=status,  # type: ignore[arg-type]
                         reward=None if reward is None else Reward(reward, dict(comps)),
                         tokens=tokens, loss_tokens=loss_tokens, domain=domain)


def test_episode_metrics_by_domain_task_and_component() -> None:
    m = episode_metrics([
        rec(1.0, "math", "t1", all_pass=1.0, format=1.0),
        rec(0.0, "math", "t1", all_pass=0.0, format=0.5),
        rec(0.5, "code", "t2", tokens=20, loss_tokens=8, format=1.0),
        rec(None, "code", "t2", status="infra_error", tokens=0, loss_tokens=0),
    ])
    assert m["episodes"] == 4 and m["reward_mean"] == pytest.approx(0.5)
    assert m["infra_rate"] == pytest.approx(0.25)
    assert m["pass_rate"] == pytest.approx(1 / 3)  # all_pass, else reward >= 1
    assert m["domain/math/reward_mean"] == pytest.approx(0.5)
    assert m["domain/math/pass_rate"] == pytest.approx(0.5)
    assert m["domain/math/infra_rate"] == 0.0
    assert m["domain/code/reward_mean"] == pytest.approx(0.5)  # the infra episode not scored
    assert m["domain/code/infra_rate"] == pytest.approx(0.5)
    assert m["domain/code/tokens"] == 20 and m["domain/code/loss_tokens"] == 8
    assert m["task/t1/episodes"] == 2 and m["task/t2/pass_rate"] == 0.0
    assert m["component/format/mean"] == pytest.approx(2.5 / 3)
    assert m["component/all_pass/mean"] == pytest.approx(0.5)
    assert math.isnan(episode_metrics([])["reward_mean"])


def test_slashes_in_names_stay_one_key_part() -> None:
    m = episode_metrics([rec(1.0, "a/b", "dir/task")])
    assert "domain/a_b/reward_mean" in m and "task/dir_task/reward_mean" in m


def test_group_outcomes_and_masked_counts() -> None:
    outcomes = [
        group_outcome([rec(1.0), rec(0.0)]),  # positive, varied
        group_outcome([rec(0.0), rec(0.0)]),  # negative, zero variance
        group_outcome([rec(1.0), rec(1.0)]),  # positive, zero variance
        group_outcome([rec(None, status="infra_error")]),
    ]
    g = group_metrics(outcomes, filtered=2)
    assert g == {"groups/total": 4, "groups/positive": 2, "groups/negative": 1,
                 "groups/zero_variance": 2, "groups/all_infra": 1, "groups/filtered": 2}
    masked = masked_metrics([rec(1.0), rec(None, status="infra_error"), rec(0.0, tokens=0)], 4)
    assert masked == {"masked/infra": 1, "masked/filtered": 4, "masked/empty": 1}


def test_deltas_against_each_domains_first_step() -> None:
    first: dict[str, float] = {}
    r1 = with_deltas({"step": 1, "domain/a/reward_mean": 0.2}, first)
    r2 = with_deltas({"step": 2, "domain/a/reward_mean": 0.5, "domain/b/reward_mean": 0.9}, first)
    r3 = with_deltas({"step": 3, "domain/a/reward_mean": float("nan"),
                      "domain/b/reward_mean": 0.4}, first)
    assert r1["domain/a/reward_delta"] == 0.0
    assert r2["domain/a/reward_delta"] == pytest.approx(0.3)
    assert r2["domain/b/reward_delta"] == 0.0  # b's first step is step 2
    assert "domain/a/reward_delta" not in r3 and r3["domain/b/reward_delta"] == pytest.approx(-0.5)
    assert first_values([r1, r2, r3]) == first  # a resume starts from the logged rows


def test_task_domain_from_domain_family_or_directory() -> None:
    assert task_domain(Task(id="x", prompt="p", data={"domain": "d", "family": "f"})) == "d"
    assert task_domain(Task(id="x", prompt="p", data={"family": "f"})) == "f"
    assert task_domain(Task(id="x", prompt="p")) == "unknown"
    assert with_domain(Task(id="x", prompt="p"), "harbor").data["domain"] == "harbor"
    assert with_domain(Task(id="x", prompt="p", data={"family": "f"}), "dir").data["domain"] == "f"


def test_record_carries_the_domain() -> None:
    t = Trajectory(session_id="s", tokens=[1], mask=[1], logprobs=[-1.0], versions=[0],
                   provenance=["generated"], task_id="t", domain="math", reward=Reward(1.0))
    assert t.record().domain == "math"


async def test_buffer_stats_carry_domains_groups_and_masked() -> None:
    buf = TrajectoryBuffer(checked(TrainSection, group_size=2, groups_per_batch=1,
                                   filter_zero_variance=True), "grpo")

    def traj(r: float | None, status: str = "ok") -> Trajectory:
        return Trajectory(session_id="s", tokens=[1, 2], mask=[0, 1], logprobs=[None, -0.5],
                          versions=[None, 0], provenance=["prompt", "generated"], task_id="t",
                          domain="math", reward=None if r is None else Reward(r),
                          status=status)  # type: ignore[arg-type]

    assert buf.add_trajectories("g1", "t", [traj(1.0), traj(0.0)])
    assert not buf.add_trajectories("g2", "t", [traj(0.0), traj(0.0)])  # zero variance
    assert not buf.add_trajectories("g3", "t", [traj(None, "infra_error")])
    assert await buf.next_batch(0, 1) is not None  # a step's stats are those of its batch
    s = await buf.take_recent_stats()
    assert s["domain/math/reward_mean"] == pytest.approx(0.25)
    assert s["domain/math/infra_rate"] == pytest.approx(0.2)
    assert s["groups/total"] == 3 and s["groups/positive"] == 1 and s["groups/negative"] == 1
    assert s["groups/zero_variance"] == 1 and s["groups/filtered"] == 1
    assert s["masked/filtered"] == 2 and s["masked/infra"] == 1
    assert (await buf.take_recent_stats())["groups/total"] == 0  # reset per step


def test_timing_metrics_average_each_phase_over_the_episodes_that_timed_it():
    a = rec(1.0)
    a.timings = {"verify_s": 1.0, "chat_s": 2.0}
    b = rec(0.0)
    b.timings = {"verify_s": 3.0, "open_s": float("nan")}
    out = timing_metrics([a, b, rec(0.5)])
    assert out == {"time/episode/verify_s": 2.0, "time/episode/chat_s": 2.0}


def test_the_ledgers_rerender_checks_become_step_metrics() -> None:
    """TITO invariant 7 at run time: each sample's re-render check travels in the episode's
    record as counts, and a step logs the share that mismatched and each kind summed."""
    from rl360.actors.reward_stats import tito_metrics
    from rl360.types import Sample

    matched = Trajectory(session_id="s", tokens=[1], mask=[1], logprobs=[-1.0], versions=[0],
                         provenance=["generated"], reward=Reward(1.0), rerender={"match": True})
    drifted = Trajectory(session_id="s", tokens=[1], mask=[1], logprobs=[-1.0], versions=[0],
                         provenance=["generated"], reward=Reward(0.0),
                         rerender={"match": False, "special_token_count": 0,
                                   "special_token_type": 1, "eos_alias": 0,
                                   "assistant_text": 2, "non_assistant_text": 0})
    drifted.branches = [Sample(node=1, tokens=[1], mask=[1], logprobs=[-1.0], versions=[0],
                               provenance=["generated"],
                               rerender={"match": False, "error": "template cannot re-render"})]
    unchecked = Trajectory(session_id="s", tokens=[1], mask=[1], logprobs=[-1.0], versions=[0],
                           provenance=["generated"], reward=Reward(0.0))
    recs = [t.record() for t in (matched, drifted, unchecked)]
    assert recs[0].rerender == {"checked": 1}
    assert recs[1].rerender == {"checked": 2, "mismatch": 2, "special_token_type": 1,
                                "assistant_text": 2, "error": 1}
    assert recs[2].rerender == {}
    m = tito_metrics(recs)
    assert m["tito/rerender_checked"] == 3
    assert m["tito/rerender_mismatch_rate"] == pytest.approx(2 / 3)
    assert m["tito/special_token_type"] == 1 and m["tito/assistant_text"] == 2
    assert m["tito/non_assistant_text"] == 0 and m["tito/error"] == 1
    assert tito_metrics([recs[2]]) == {}  # nothing checked: nothing logged
