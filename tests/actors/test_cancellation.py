"""Tail cancellation reaches the episode: ray.cancel on an env actor's rollout cancels the
episode's asyncio task, which cancels its chat call on the session shard (so the engine request
is dropped) and closes its session there instead of leaving it open until its TTL."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import ray

from rl360.actors.env_pool import cancel_episodes
from rl360.recipe import EnvSection, ModelSection, ServeSection
from rl360.serve.sessions.service import LocalEngineClient
from rl360.types import Generation, SamplingParams, Task

pytestmark = pytest.mark.ray

NS = "rl360-tests"


class Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def note(self, event: str) -> None:
        self.events.append(event)

    def log(self) -> list[str]:
        return self.events


class HangingEngine(LocalEngineClient):
    """An engine whose generations never finish; it tells the recorder when one starts and
    when one is cancelled (dropped)."""

    def __init__(self, recorder: Any) -> None:
        super().__init__(None)
        self.recorder = recorder

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       route_key: str | None) -> Generation:
        await self.recorder.note.remote("generate")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.recorder.note.remote("cancelled")
            raise
        raise AssertionError("unreachable")


def wait_for(fn, what: str, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not fn():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def hanging_stack(shard_name: str, shard_cls: Any = None) -> tuple[Any, Any, Any]:
    """A recorder, a session shard over HangingEngine and an env actor using that shard."""
    from rl360.actors.env_pool import EnvActor, with_plain_asyncio
    from rl360.serve.sessions.shard import SessionShard

    recorder = ray.remote(Recorder).remote()
    shard = ray.remote(shard_cls or SessionShard).options(name=shard_name, namespace=NS).remote(
        ModelSection(), ServeSection(), "rl360", HangingEngine(recorder))
    env = ray.remote(EnvActor).options(
        **with_plain_asyncio({"num_cpus": 0}), max_concurrency=4).remote(
        EnvSection(sandbox="process"), {"max_tokens": 8}, [shard_name], NS,
        "http://127.0.0.1:1")
    return recorder, shard, env


def test_a_cancelled_episode_closes_its_session_and_drops_its_engine_request(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    recorder, shard, env = hanging_stack("rl360-test-shard")
    record, data = env.rollout.remote(Task(id="t0", prompt="x", data={"tests": ["assert True"]}),
                                      "g0", None)
    # the first wait includes starting the env actor's worker (its own runtime env): slow
    # on a loaded 2-core box (60 s was not always enough under a 2-process CPU hog)
    wait_for(lambda: "generate" in ray.get(recorder.log.remote()), "the episode's first chat",
             timeout_s=240)
    assert ray.get(shard.stats.remote())["open_sessions"] == 1
    cancel_episodes([record, data])  # as the controller does: once per task
    with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
        ray.get(data, timeout=60)
    wait_for(lambda: ray.get(shard.stats.remote())["open_sessions"] == 0, "the session to close")
    stats = ray.get(shard.stats.remote())
    assert stats["sessions_closed"] == 1 and stats.get("sessions_reaped", 0) == 0
    wait_for(lambda: "cancelled" in ray.get(recorder.log.remote()), "the engine request to drop")
    for a in (env, shard, recorder):
        ray.kill(a)


def test_a_cancelled_group_closes_every_session_and_drops_its_batched_request(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """The group path (`rollout_group`): the members' first turns reach the shard in one
    `turns` call and the engine in one request; cancelling the group cancels that call, every
    generation in it, and closes every session."""
    recorder, shard, env = hanging_stack("rl360-test-shard-g")
    outs = env.rollout_group.options(num_returns=4).remote(
        Task(id="t0", prompt="x", data={"tests": ["assert True"]}), "g0", 3, None)
    wait_for(lambda: ray.get(recorder.log.remote()).count("generate") == 3, "the first turns",
             timeout_s=240)  # includes the env actor's worker start (see above)
    assert ray.get(shard.stats.remote())["open_sessions"] == 3
    assert cancel_episodes(outs) == 1  # four returns, one task
    with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
        ray.get(outs[1], timeout=60)
    wait_for(lambda: ray.get(shard.stats.remote())["open_sessions"] == 0, "the sessions to close")
    stats = ray.get(shard.stats.remote())
    assert stats["sessions_closed"] == 3 and stats.get("sessions_reaped", 0) == 0
    wait_for(lambda: ray.get(recorder.log.remote()).count("cancelled") == 3,
             "the engine requests to drop")
    for a in (env, shard, recorder):
        ray.kill(a)


def slow_close_shard() -> Any:
    from rl360.serve.sessions.shard import SessionShard

    class SlowCloseShard(SessionShard):
        async def close(self, sid: str, token: str | None, forest: bool = True) -> Any:
            await asyncio.sleep(1.0)
            return await super().close(sid, token, forest)

    return SlowCloseShard


def test_a_repeated_recursive_cancel_does_not_leave_the_sessions_open(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """Ray repeats a cancel until the task ends, and a recursive one (ray.cancel's default)
    also cancels the calls the task made, the session closes among them: the flake this test
    pins down left a cancelled group's sessions open (the closes were cancelled on the
    shard). The env actor sends a cancelled close again."""
    recorder, shard, env = hanging_stack("rl360-test-shard-r", slow_close_shard())
    outs = env.rollout_group.options(num_returns=4).remote(
        Task(id="t0", prompt="x", data={"tests": ["assert True"]}), "g0", 3, None)
    wait_for(lambda: ray.get(recorder.log.remote()).count("generate") == 3, "the first turns",
             timeout_s=240)
    ray.cancel(outs[0])
    time.sleep(0.3)  # the closes are on the shard now (each takes 1 s)
    ray.cancel(outs[0])  # recursive: cancels them
    with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
        ray.get(outs[1], timeout=60)
    wait_for(lambda: ray.get(shard.stats.remote())["open_sessions"] == 0, "the sessions to close")
    assert ray.get(shard.stats.remote())["sessions_closed"] == 3
    for a in (env, shard, recorder):
        ray.kill(a)
