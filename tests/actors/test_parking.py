"""Task parking (actors/parking.py): which groups park a task, how long it stays parked, what
brings it back; the ledger's accounting of parked offers; the all-task reward the driver logs."""

from __future__ import annotations

from rl360.actors.parking import TaskParking, no_signal
from rl360.actors.reward_stats import TaskRewards
from rl360.actors.run_ledger import account
from rl360.types import EpisodeRecord, Reward


def recs(*rewards: float | None) -> list[EpisodeRecord]:
    """A group's records; None: an infrastructure failure."""
    return [EpisodeRecord(task_id="t", group_id="g", status="ok" if r is not None else "infra_error",
                          reward=Reward(r) if r is not None else None) for r in rewards]


def test_no_signal_is_an_all_failed_group() -> None:
    assert no_signal(recs(0.0, 0.0, 0.0)) is True
    assert no_signal(recs(-0.3, -0.3)) is True  # all penalised alike: still no advantage
    assert no_signal(recs(0.0, 0.0, None)) is True  # the infra failure is not scored
    assert no_signal(recs(0.0, 1.0)) is False
    assert no_signal(recs(-0.3, 0.0)) is False  # variance is a signal
    assert no_signal(recs(1.0, 1.0)) is False  # solved: kept (forgetting shows there first)
    assert no_signal(recs(0.5, 0.5)) is False
    assert no_signal(recs(None, None)) is None  # says nothing about the task


def test_parked_after_k_groups_skipped_for_p_offers_then_probed() -> None:
    p = TaskParking(after=2, passes=3)
    assert not p.skip("h")
    assert not p.settled("h", recs(0, 0))  # 1 all-failed group: not yet
    assert not p.skip("h")
    assert p.settled("h", recs(0, 0))  # 2 in a row: parked
    assert [p.skip("h") for _ in range(4)] == [True, True, True, False]  # 3 skips, a probe
    assert "h" not in p.parked
    assert p.settled("h", recs(0, 0))  # the probe failed too: parked again at once
    assert [p.skip("h") for _ in range(4)] == [True, True, True, False]
    assert not p.settled("h", recs(0, 1))  # the probe found a success: back for good
    assert not p.skip("h") and p.streak["h"] == 0
    for _ in range(5):  # it gave signal once: failing again later never parks it
        assert not p.settled("h", recs(0, 0))
    assert not p.skip("h")


def test_only_a_task_that_never_gave_signal_is_parked_and_infra_groups_change_nothing() -> None:
    """A task the policy solved once and then lost keeps running: sampling is its way back."""
    p = TaskParking(after=2, passes=1)
    p.settled("lost", recs(1, 0))
    assert not any(p.settled("lost", recs(0, 0)) for _ in range(6))
    assert not p.skip("lost")
    p.settled("t", recs(0, 0))
    assert not p.settled("t", recs(None, None))  # all infra: neither counts nor resets
    assert p.settled("t", recs(0, 0))
    assert not p.skip("other")  # other tasks are not affected


def test_off_by_default_and_the_state_survives_a_resume() -> None:
    off = TaskParking(after=0, passes=4)
    for _ in range(5):
        assert not off.settled("h", recs(0, 0))
    assert not off.skip("h")
    p = TaskParking(after=1, passes=2)
    p.settled("h", recs(0, 0))
    p.skip("h")
    q = TaskParking(after=1, passes=2)
    q.load(p.state())
    assert [q.skip("h") for _ in range(2)] == [True, False]  # one skip was already spent
    p.settled("s", recs(1, 0))
    q.load(p.state())
    assert not q.settled("s", recs(0, 0)) and "s" in q.signalled
    q.load(None)
    assert not q.skip("h")


def test_a_parked_offer_is_not_a_lost_occurrence() -> None:
    rows = [
        {"step": 1, "kind": "step", "events": [
            {"ev": "start", "occ": 0, "gid": "g0", "task": "a"},
            {"ev": "park", "occ": 1, "task": "h"},
            {"ev": "start", "occ": 2, "gid": "g1", "task": "b"},
            {"ev": "settle", "occ": 0, "gid": "g0", "task": "a"},
            {"ev": "settle", "occ": 2, "gid": "g1", "task": "b"}]},
        {"step": 2, "kind": "checkpoint", "tasks_taken": 4, "pending_occ": [], "events": []},
    ]
    acc = account(rows, group_size=2)
    assert acc["parked_skips"] == 1
    assert acc["lost_occ"] == [3]  # taken, neither settled, pending nor parked: lost


def test_task_rewards_count_every_task_once_at_its_latest_group() -> None:
    t = TaskRewards()
    assert t.mean() != t.mean()  # nan before any step
    t.update({"task/a/reward_mean": 1.0, "task/h/reward_mean": 0.0, "reward_mean": 0.5,
              "task/a/pass_rate": 1.0, "domain/x/reward_mean": 0.7})
    assert t.mean() == 0.5
    t.update({"task/a/reward_mean": 0.5, "task/b/reward_mean": float("nan")})  # h: parked
    assert t.by_task == {"a": 0.5, "h": 0.0} and t.mean() == 0.25
