"""The data path streams: the controller fetches only the episodes' small records,
the buffer and the driver hold refs, and the trainer ranks fetch the token data of their own
shard. What the controller and the driver receive does not grow with the sequence length."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray

from rl360.actors.buffer import TrajectoryBuffer
from rl360.actors.controller import RolloutController
from rl360.actors.env_pool import GroupRollout
from rl360.actors.trainer_group import TrainerGroup
from rl360.recipe import TrainerSection, TrainSection, checked
from rl360.types import Reward, Task, Trajectory
from rl360.weights.publisher import WeightPublisher

pytestmark = pytest.mark.ray


class LongEnvActor(GroupRollout):
    """Episodes of `length` tokens (half of them generated), rewards 0/1 alternating."""

    def __init__(self, length: int) -> None:
        self.length, self.n = length, 0

    @ray.method(num_returns=2)
    async def rollout(self, task: Task, group_id: str, sampling: dict | None = None) -> tuple:
        self.n += 1
        half = self.length // 2
        t = Trajectory(session_id="s", tokens=[(i * 7) % 200 + 1 for i in range(self.length)],
                       mask=[0] * half + [1] * (self.length - half),
                       logprobs=[None] * half + [-1.0] * (self.length - half),
                       versions=[None] * half + [0] * (self.length - half),
                       provenance=["prompt"] * half + ["generated"] * (self.length - half),
                       task_id=task.id, group_id=group_id, reward=Reward(float(self.n % 2)))
        return t.record(), t


def one_batch(tasks_file: str, length: int) -> tuple[int, float, object, object]:
    """(pickled bytes of the batch the driver receives, record bytes per episode the
    controller fetched, the batch, the env actor)."""
    train = checked(TrainSection, tasks=[tasks_file], group_size=2, groups_per_batch=2,
                    max_staleness=0, max_in_flight_groups=2)
    env = ray.remote(LongEnvActor).remote(length)
    buf = ray.remote(TrajectoryBuffer).remote(train, "drgrpo")
    pub = ray.remote(WeightPublisher).remote()
    ctl = ray.remote(RolloutController).options(max_concurrency=100).remote(train, 1, [env], buf, pub)
    ray.get(ctl.start.remote())
    batch = ray.get(buf.next_batch.remote(0, 1, 60.0))
    assert batch is not None and len(batch.members) == 4
    # the buffer cut the batch once it took both groups; the controller counts a group when
    # the buffer's answer reaches it, which may come a moment later
    deadline = time.monotonic() + 30
    while ray.get(ctl.status.remote())["count/groups_done"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    status = ray.get(ctl.stop.remote())
    episodes = status["count/groups_done"] * 2
    return (len(ray.cloudpickle.dumps(batch)), status["count/record_bytes"] / episodes, batch,
            (env, buf, pub, ctl))


def test_controller_and_driver_hold_only_records_and_refs(ray_cluster, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                          tiny_dir: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "instruction": "x", "tests": ["assert 1"]})
                             + "\n" for i in range(4)))
    short_bytes, short_record, _, _ = one_batch(str(tasks), 40)
    long_bytes, long_record, batch, _ = one_batch(str(tasks), 40_000)
    # 40k tokens per episode are ~300 kB of ids alone; what the driver and the controller got
    # does not grow with them (Ray inlines objects under 100 kB into a passed ref, so the short
    # batch may even be the larger one; the long one is refs and numbers only)
    assert long_bytes <= short_bytes + 64 and long_bytes < 4096, (short_bytes, long_bytes)
    assert abs(long_record - short_record) <= 16, (short_record, long_record)
    # the tokens are still there, behind the refs, for whoever trains on them
    members = batch.members  # type: ignore[attr-defined]
    assert all(isinstance(m.ref, ray.ObjectRef) for m in members)
    assert len(ray.get(members[0].ref).tokens) == 40_000
    # and a trainer rank fetches them itself: the step sees every loss token
    group = TrainerGroup(TrainerSection(num_cpus=0, micro_batch_tokens=0), tiny_dir)
    try:
        _, _, small, _ = one_batch(str(tasks), 40)
        m = group.train_step(small)  # type: ignore[arg-type]
        assert m["tokens"] == 4 * 20 and m["local_tokens"] == 4 * 20
        assert m["staleness_tokens/0"] == 4 * 20
    finally:
        group.shutdown()
