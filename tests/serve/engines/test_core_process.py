"""The torch engine in a child process (`engine.core_process = true`): the same generations as
the engine in process, weight versions through the replica's shared buffer, cancellation, bad
input, and a core that dies."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.base import build_engine_backend
from rl360.serve.engines.core_process import CoreDied, CoreProcessBackend
from rl360.serve.engines.torch_backend import TorchBackend, load_causal_lm
from rl360.types import SamplingParams
from rl360.weights.payloads import TensorUpdate

PROMPTS = [[5, 6, 7], list(range(100, 140)), [9], [200, 201, 3, 4]]


def sampled(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=12, seed=100 + i)


async def until(be: CoreProcessBackend, cond) -> None:  # type: ignore[no-untyped-def]
    """Ask the core for its health until `cond(health)` holds."""
    for _ in range(3000):
        if cond(await be.refresh_health()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def engine(**kw) -> EngineSection:  # type: ignore[no-untyped-def]
    return EngineSection(batch_wait_ms=0, threads=1, **kw)


async def in_process(tiny_dir, state=None):  # type: ignore[no-untyped-def]
    lm = load_causal_lm(str(tiny_dir), "float32")
    be = TorchBackend(engine(), ModelSection(path=str(tiny_dir)), model=lm[0], tokenizer=lm[1])
    try:
        if state is not None:
            assert await be.update_weights(1, TensorUpdate(state))
        return await asyncio.gather(*(be.generate(p, sampled(i)) for i, p in enumerate(PROMPTS)))
    finally:
        await be.close()


def changed_state(tiny_dir):  # type: ignore[no-untyped-def]
    lm = load_causal_lm(str(tiny_dir), "float32")[0]
    gen = torch.Generator().manual_seed(0)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in lm.state_dict().items()}


async def test_core_process_generates_what_the_engine_in_process_does(tiny_dir) -> None:  # type: ignore[no-untyped-def]
    be = build_engine_backend(engine(core_process=True), ModelSection(path=str(tiny_dir)))
    assert isinstance(be, CoreProcessBackend) and be.core_pid != os.getpid()
    try:
        got = await asyncio.gather(*(be.generate(p, sampled(i)) for i, p in enumerate(PROMPTS)))
        want = await in_process(tiny_dir)
        assert [g.token_ids for g in got] == [g.token_ids for g in want]
        for g, w in zip(got, want, strict=True):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
            assert g.finish_reason == w.finish_reason
        health = await be.refresh_health()
        assert health["ok"] and health["core_process"] and health["requests"] == len(PROMPTS)

        # a weight version goes through the replica's buffer: the same tokens as the engine
        # in process given the same version, and the version is reported
        state = changed_state(tiny_dir)
        assert await be.update_weights(1, TensorUpdate(state))
        assert be.version == 1
        assert not await be.update_weights(1, TensorUpdate(state)), "an equal version must be refused"
        got = await asyncio.gather(*(be.generate(p, sampled(i)) for i, p in enumerate(PROMPTS)))
        want = await in_process(tiny_dir, state)
        assert [g.token_ids for g in got] == [g.token_ids for g in want]
        assert all(g.policy_version == 1 for g in got)

        # bad input is the caller's error, with the reason, and the core keeps serving
        with pytest.raises(ValueError, match="empty"):
            await be.generate([], sampled(0))
        with pytest.raises(ValueError, match="max_model_len"):
            await be.generate(list(range(5000)), sampled(0))
        with pytest.raises(TypeError, match="name -> tensor"):
            await be.update_weights(2, [1, 2])

        # a cancelled caller's row leaves the core's batch
        task = asyncio.create_task(be.generate([1, 2, 3], SamplingParams(max_tokens=4000, seed=1)))
        await until(be, lambda h: h["running"] == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(be, lambda h: h["running"] == 0)
        assert be.health()["cancelled"] == 1
        assert (await be.generate([5, 6], sampled(1))).token_ids
    finally:
        await be.close()
    assert be._proc.poll() is not None, "close() must end the core process"


async def test_a_core_that_dies_fails_its_requests_and_its_health(tiny_dir) -> None:  # type: ignore[no-untyped-def]
    be = CoreProcessBackend(engine(core_process=True), ModelSection(path=str(tiny_dir)))
    try:
        await be.generate([5, 6, 7], sampled(0))
        task = asyncio.create_task(be.generate([1, 2, 3], SamplingParams(max_tokens=4000, seed=1)))
        await until(be, lambda h: h["running"] == 1)
        os.kill(be.core_pid, signal.SIGKILL)  # our own child, by its pid
        with pytest.raises(CoreDied, match="exited"):
            await task
        assert not be.health()["ok"] and "exited" in be.health()["error"]
        with pytest.raises(CoreDied, match="gone"):
            await be.generate([5], sampled(0))
    finally:
        await be.close()


def test_core_process_is_for_the_torch_backend_only() -> None:
    with pytest.raises(ValueError, match="core_process"):
        EngineSection(backend="vllm", core_process=True)


def test_core_process_refuses_what_it_cannot_load() -> None:
    from rl360.recipe import apply_overrides, decode_recipe

    with pytest.raises(ValueError, match="num_gpus"):
        EngineSection(core_process=True, num_gpus=1)
    with pytest.raises(ValueError, match="delta"):
        decode_recipe(apply_overrides({}, [
            "engine.core_process=true", "train.weight_sync.transport='object_store'",
            "train.weight_sync.delta=true"]))
    decode_recipe(apply_overrides({}, ["engine.core_process=true"]))


def test_the_core_exits_when_its_replica_process_dies(tiny_dir) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys
    import time

    code = ("import os\nfrom rl360.recipe import EngineSection, ModelSection\n"
            "from rl360.serve.engines.core_process import CoreProcessBackend\n"
            "be = CoreProcessBackend(EngineSection(core_process=True, threads=1), "
            f"ModelSection(path={str(tiny_dir)!r}))\n"
            "print(be.core_pid, flush=True)\nos._exit(0)  # no close(): a replica that died\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    pid = int(out.stdout.split()[-1])

    def gone() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 60
    while not gone():
        assert time.monotonic() < deadline, f"the engine core {pid} outlived its replica"
        time.sleep(0.05)


async def test_shards_reach_the_core_over_its_channel(tiny_dir) -> None:  # type: ignore[no-untyped-def]
    from rl360.serve.engines.core_client import CoreChannels, CoreConnection
    from rl360.serve.engines.core_wire import Update
    from rl360.serve.engines.replica import _over_channel
    from rl360.serve.engines.routing import rank_replicas

    be = CoreProcessBackend(engine(core_process=True), ModelSection(path=str(tiny_dir)))
    try:
        assert not be.health().get("channel"), "no channel before the replica opens it"
        path = await be.open_channel()
        assert be.health()["channel"] == path and os.stat(os.path.dirname(path)).st_mode & 0o077 == 0
        conn = await CoreConnection.open_unix(path, "test-channel")
        got = await asyncio.gather(*(conn.generate(p, sampled(i)) for i, p in enumerate(PROMPTS)))
        want = await asyncio.gather(*(be.generate(p, sampled(i)) for i, p in enumerate(PROMPTS)))
        assert [g.token_ids for g in got] == [g.token_ids for g in want]
        assert (await be.refresh_health())["direct_requests"] == len(PROMPTS)
        # the channel takes generations only: no weights, pause or close from a shard
        with pytest.raises(ValueError, match="generations only"):
            await conn.request(lambda i: Update(i, 5, os.getpid(), 0, []))
        # as the shard's client answers: the replica named, each of generate_many failing alone
        many = await _over_channel("generate_many", "r1", conn,
                                   [(PROMPTS[0], sampled(0)), ([], sampled(1))])
        assert many[0].engine_replica == "r1" and many[0].token_ids == want[0].token_ids
        assert isinstance(many[1], ValueError)
        # a shard that goes away mid-generation: its row leaves the core's batch
        task = asyncio.create_task(conn.generate([1, 2, 3], SamplingParams(max_tokens=4000, seed=1)))
        await until(be, lambda h: h["running"] == 1)
        conn.close()
        with pytest.raises(CoreDied, match="closed"):
            await task
        await until(be, lambda h: h["running"] == 0)

        # the shard's table: the session's replica by rendezvous hashing; its core is used only
        # on the same node, and an unreachable channel sends the call through Serve
        channels = CoreChannels(("unused", "unused"))
        listed = {"r1": {"path": path, "node": "node-a"},
                  "r2": {"path": "/nonexistent/engine.sock", "node": "node-a"},
                  "r3": {"path": path, "node": "node-b"}}

        async def fetch() -> dict:
            return dict(listed)

        channels._fetch = fetch  # type: ignore[method-assign]
        channels._node = "node-a"
        keys = {rank_replicas(f"s{i}", ["r1", "r2", "r3"])[0]: f"s{i}" for i in range(64)}
        picked = await channels.pick(keys["r1"])
        assert picked is not None and picked[0] == "r1"
        assert (await picked[1].generate(PROMPTS[0], sampled(0))).token_ids == want[0].token_ids
        assert await channels.pick(keys["r3"]) is None, "another node's core goes through Serve"
        assert await channels.pick(keys["r2"]) is None, "an unreachable core goes through Serve"
        assert "r2" not in channels._table

        # r1 leaves the listing (say the publisher restarted) while a call waits on it: the
        # call completes, r1 gets no new calls, and its connection closes once idle
        task = asyncio.create_task(picked[1].generate([1, 2, 3], SamplingParams(max_tokens=800,
                                                                                 seed=2)))
        await until(be, lambda h: h["running"] == 1)
        del listed["r1"]
        await channels._refresh()
        assert not picked[1].closed, "a connection with a call under way must stay open"
        assert (await task).token_ids
        assert rank_replicas(keys["r1"], list(channels._table))[0] != "r1"
        await channels._refresh()
        assert picked[1].closed and "r1" not in channels._conns
        channels.close()
    finally:
        await be.close()
    assert not await asyncio.to_thread(os.path.exists, path), \
        "the core removes its channel's socket when it ends"


async def test_the_publisher_lists_open_healthy_recent_channels() -> None:
    from rl360.weights.publisher import WeightPublisher

    pub = WeightPublisher()
    await pub.report_stats("r1", {"ok": True, "channel": "/x/1.sock", "core_node": "n1"})
    await pub.report_stats("r2", {"ok": True, "channel": ""})  # not open yet
    await pub.report_stats("r3", {"ok": False, "channel": "/x/3.sock", "core_node": "n1"})
    await pub.report_stats("r4", {"ok": True, "channel": "/x/4.sock", "core_node": "n2"})
    pub.stats_at["r4"] -= 60.0  # has not reported for a minute
    assert await pub.channels() == {"r1": {"path": "/x/1.sock", "node": "n1"}}
