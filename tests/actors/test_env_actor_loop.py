"""Env actors run the standard asyncio loop: uvloop's subprocess spawn runs Python's after-fork
hook in the child, which can deadlock on a lock held by another thread and freeze the actor
(rl360.actors.env_pool.with_plain_asyncio)."""

from __future__ import annotations

import asyncio

import pytest

from rl360.actors.env_pool import with_plain_asyncio

pytestmark = pytest.mark.ray


class LoopProbe:
    async def loop_module(self) -> str:
        return type(asyncio.get_running_loop()).__module__


def test_env_actor_options_select_plain_asyncio(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    import ray

    uvloop = pytest.importorskip("uvloop", reason="without uvloop every loop is asyncio's")
    del uvloop
    cls = ray.remote(LoopProbe)
    default = cls.options(num_cpus=0).remote()
    plain = cls.options(**with_plain_asyncio({"num_cpus": 0})).remote()
    assert ray.get(default.loop_module.remote()).startswith("uvloop")  # Ray's default
    assert ray.get(plain.loop_module.remote()).startswith("asyncio")
    for a in (default, plain):
        ray.kill(a)


def test_with_plain_asyncio_keeps_the_callers_runtime_env() -> None:
    opts = with_plain_asyncio({"num_cpus": 1, "runtime_env": {"env_vars": {"A": "1"}, "pip": ["x"]}})
    assert opts["num_cpus"] == 1
    assert opts["runtime_env"] == {"env_vars": {"A": "1", "RAY_USE_UVLOOP": "0"}, "pip": ["x"]}
