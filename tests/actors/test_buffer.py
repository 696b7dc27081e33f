"""The trajectory buffer: groups, advantages with infra failures excluded, staleness, batches."""

from __future__ import annotations

import asyncio

import pytest

from rl360.actors.buffer import TrajectoryBuffer
from rl360.recipe import TrainSection, checked
from rl360.types import Reward, Trajectory


def traj(reward: float | None, version: int = 0, status: str = "ok", task: str = "t") -> Trajectory:
    return Trajectory(
        session_id="s", tokens=[1, 2, 3, 4], mask=[0, 0, 1, 1], logprobs=[None, None, -0.5, -0.7],
        versions=[None, None, version, version], provenance=["prompt"] * 2 + ["generated"] * 2,
        task_id=task, group_id="g", reward=None if reward is None else Reward(reward),
        status=status,  # type: ignore[arg-type]
    )


def make(**kw) -> TrajectoryBuffer:  # type: ignore[no-untyped-def]
    cfg = {"group_size": 4, "groups_per_batch": 1, "max_staleness": 1, **kw}
    return TrajectoryBuffer(checked(TrainSection, **cfg), "grpo")


async def test_infra_failure_does_not_move_the_other_advantages() -> None:
    clean, with_infra = make(), make()
    clean.add_trajectories("g", "t", [traj(1.0), traj(0.0), traj(0.5)])
    with_infra.add_trajectories("g", "t", [traj(1.0), traj(0.0), traj(None, status="infra_error"),
                                          traj(0.5)])
    a = [m.advantage for m in (await clean.next_batch(0, 1)).members]  # type: ignore[union-attr]
    b = (await with_infra.next_batch(0, 1))
    assert b is not None and len(b.members) == 3  # the infra episode is not trained on
    assert [m.advantage for m in b.members] == pytest.approx(a)
    stats = await with_infra.take_recent_stats()
    assert stats["episodes"] == 3 and stats["reward_mean"] == pytest.approx(0.5)


async def test_zero_variance_groups_are_filtered_but_still_counted_in_the_reward() -> None:
    buf = make(filter_zero_variance=True)
    buf.add_trajectories("g1", "t", [traj(1.0)] * 4)
    assert await buf.size() == 0
    buf.add_trajectories("g2", "t", [traj(0.0)] * 2 + [traj(1.0)] * 2)
    assert await buf.next_batch(0, 1) is not None
    stats = await buf.take_recent_stats()
    assert stats["reward_mean"] == 0.75 and stats["count/groups_zero_variance"] == 1
    assert stats["groups/filtered"] == 1 and stats["masked/filtered"] == 4


async def test_a_steps_stats_describe_the_batch_it_trained_not_every_finished_episode() -> None:
    """An async run's head start: three groups finish before the first batch (of one group)
    is cut. Each step reports its own batch's group (plus the groups filtered out before that
    cut), while `episodes_finished` counts the generation stream."""
    buf = make(filter_zero_variance=True)
    buf.add_trajectories("a", "t", [traj(1.0), traj(0.0), traj(0.0), traj(0.0)])
    buf.add_trajectories("flat", "t", [traj(0.0)] * 4)  # filtered before the first cut
    buf.add_trajectories("b", "t", [traj(1.0), traj(1.0), traj(1.0), traj(0.0)])
    buf.add_trajectories("c", "t", [traj(1.0), traj(1.0), traj(0.0), traj(0.0)])
    assert await buf.next_batch(0, 1) is not None
    first = await buf.take_recent_stats()
    assert first["episodes"] == 8 and first["reward_mean"] == pytest.approx(1 / 8)
    assert first["episodes_finished"] == 16 and first["groups/total"] == 2
    assert first["groups/filtered"] == 1
    buf.add_trajectories("flat2", "t", [traj(1.0)] * 4)  # filtered after it: the next step's
    assert await buf.next_batch(0, 2) is not None
    second = await buf.take_recent_stats()
    assert second["episodes"] == 8 and second["reward_mean"] == pytest.approx(7 / 8)
    assert second["episodes_finished"] == 4 and second["groups/filtered"] == 1
    assert await buf.next_batch(0, 3) is not None
    third = await buf.take_recent_stats()
    assert third["episodes"] == 4 and third["reward_mean"] == pytest.approx(0.5)
    assert third["episodes_finished"] == 0


async def test_stale_groups_are_dropped_and_fresh_ones_batched() -> None:
    buf = make(max_staleness=1)
    buf.add_trajectories("old", "t", [traj(1.0, version=0), traj(0.0, version=0)])
    buf.add_trajectories("new", "t", [traj(1.0, version=2), traj(0.0, version=2)])
    batch = await buf.next_batch(trainer_version=2, step=3)
    assert batch is not None and {m.max_version for m in batch.members} == {2}
    assert (await buf.take_recent_stats())["count/groups_dropped_stale"] == 1


async def test_a_batch_takes_the_oldest_policys_groups_first() -> None:
    """A slow group that completed after newer ones is trained first, before the staleness
    bound would drop it; the rest keep their completion order."""
    buf = make(max_staleness=1, groups_per_batch=2)
    buf.add_trajectories("quick-new", "t", [traj(1.0, version=2), traj(0.0, version=2)])
    buf.add_trajectories("quick-new-2", "t", [traj(1.0, version=2), traj(0.0, version=2)])
    buf.add_trajectories("slow-old", "t", [traj(1.0, version=1), traj(0.0, version=1)])
    batch = await buf.next_batch(trainer_version=2, step=3)
    assert batch is not None and sorted(m.min_version for m in batch.members) == [1, 1, 2, 2]
    later = await buf.next_batch(trainer_version=3, step=4, timeout_s=0.05)
    assert later is None and await buf.size() == 1  # quick-new-2 waits, not dropped


async def test_next_batch_waits_for_a_full_batch() -> None:
    buf = make(groups_per_batch=2)
    waiter = asyncio.create_task(buf.next_batch(0, 1, timeout_s=5))
    buf.add_trajectories("g1", "t", [traj(1.0), traj(0.0)])
    await asyncio.sleep(0.05)
    assert not waiter.done()
    buf.add_trajectories("g2", "t", [traj(1.0), traj(0.0)])
    batch = await waiter
    assert batch is not None and len(batch.members) == 4
    assert await buf.next_batch(0, 2, timeout_s=0.05) is None


async def test_state_round_trip() -> None:
    buf = make(groups_per_batch=2)
    buf.add_trajectories("g1", "t", [traj(1.0), traj(0.0)])
    other = make(groups_per_batch=2)
    await other.load_state(await buf.state())
    assert await other.size() == 1


async def test_branches_of_a_session_forest_are_trained_as_samples() -> None:
    from rl360.actors.buffer import to_samples
    from rl360.types import Sample

    buf = make()
    extra = Sample(node=0, tokens=[1, 9], mask=[0, 1], logprobs=[None, -0.2], versions=[None, 0],
                   provenance=["prompt", "generated"])
    two = traj(1.0)
    two.branches = [extra]
    buf.add_trajectories("g", "t", [two, traj(0.0)])
    batch = await buf.next_batch(0, 1)
    assert batch is not None
    assert batch.seqs == 3 and batch.loss_tokens == 2 + 1 + 2  # the branch is counted
    samples = to_samples([m.ref for m in batch.members], [m.advantage for m in batch.members])
    assert sorted(tuple(s.tokens) for s in samples) == [(1, 2, 3, 4), (1, 2, 3, 4), (1, 9)]
    adv = {tuple(s.tokens): s.advantage for s in samples if s.reward == 1.0}
    assert adv[(1, 9)] == adv[(1, 2, 3, 4)] > 0  # the episode's advantage for every leaf


async def test_positive_first_curriculum_scales_non_positive_advantages_early() -> None:
    from rl360.actors.buffer import curriculum_factor

    cfg = checked(TrainSection, curriculum={"mode": "positive-first", "steps": 5, "floor": 0.2}).curriculum
    assert [curriculum_factor(cfg, s) for s in (1, 3, 5, 9)] == pytest.approx([0.2, 0.6, 1.0, 1.0])
    plain, cur = make(), make(curriculum={"mode": "positive-first", "steps": 5, "floor": 0.2})
    for step in (1, 3, 5):
        for b in (plain, cur):
            b.add_trajectories("g", "t", [traj(1.0), traj(0.0), traj(0.0), traj(0.5)])
        a = [m.advantage for m in (await plain.next_batch(0, step)).members]  # type: ignore[union-attr]
        c = [m.advantage for m in (await cur.next_batch(0, step)).members]  # type: ignore[union-attr]
        f = curriculum_factor(cur.cfg.curriculum, step)
        assert any(x > 0 for x in a) and any(x < 0 for x in a)
        assert c == pytest.approx([x if x > 0 else x * f for x in a])


async def test_without_oversampling_a_batch_is_what_survived_of_its_groups() -> None:
    buf = make(groups_per_batch=3, oversampling=False, filter_zero_variance=True)
    varied = [traj(1.0), traj(0.0), traj(0.0), traj(1.0)]
    assert await buf.add_group("a", "t", [t.record() for t in varied], [varied], 0)
    # batch 1's group finishes first: it must not fill batch 0
    assert await buf.add_group("d", "t", [t.record() for t in varied], [varied], 1)
    flat = [traj(1.0)] * 4
    assert not await buf.add_group("b", "t", [t.record() for t in flat], [flat], 0)  # filtered
    assert await buf.next_batch(0, 1, timeout_s=0.2) is None  # batch 0 has a group running
    await buf.skip_group(0)  # ... which is tail-cancelled, not replaced
    batch = await buf.next_batch(0, 1, timeout_s=0.2)
    assert batch is not None and len(batch.members) == 4  # only group "a"
    for _ in range(2):  # batch 1: "d" plus two filtered groups
        assert not await buf.add_group("x", "t", [t.record() for t in flat], [flat], 1)
    batch = await buf.next_batch(0, 2, timeout_s=0.2)
    assert batch is not None and len(batch.members) == 4
    for _ in range(3):  # batch 2: nothing survived, skipped; batch 3 comes next
        await buf.skip_group(2)
    assert await buf.add_group("e", "t", [t.record() for t in varied], [varied], 3)
    assert await buf.close_open_batches() == 4  # a resume: batch 3's other groups are gone
    batch = await buf.next_batch(0, 3, timeout_s=0.2)
    assert batch is not None and len(batch.members) == 4
    stats = await buf.take_recent_stats()
    assert stats["count/batches_empty"] == 1 and stats["count/groups_not_replaced"] == 2 + 2 + 3 + 2


async def test_without_oversampling_a_resume_cuts_the_batches_that_had_groups_in_flight() -> None:
    """The checkpoint saw batch 0's second group and batch 1's first group in flight (their
    tasks run again in new batches): the restored buffer cuts batches 0 and 1 with what settled
    and the controller numbers new groups from batch 2."""
    old = make(groups_per_batch=2, oversampling=False)
    varied = [traj(1.0), traj(0.0), traj(0.0), traj(1.0)]
    assert await old.add_group("a", "t", [t.record() for t in varied], [varied], 0)
    assert await old.add_group("d", "t", [t.record() for t in varied], [varied], 1)
    new = make(groups_per_batch=2, oversampling=False)
    await new.load_state(await old.state())
    assert await new.next_batch(0, 1, timeout_s=0.1) is None
    assert await new.close_open_batches() == 2
    for step in (1, 2):
        batch = await new.next_batch(0, step, timeout_s=0.2)
        assert batch is not None and len(batch.members) == 4
    assert await new.next_batch(0, 3, timeout_s=0.1) is None
