"""The engine Serve deployment: one backend per replica, behind the engine contract.

Replicas are reached through a DeploymentHandle with `session_id` set, and the
SessionAffinityRouter keeps a session on one replica. Each replica follows the WeightPublisher
actor (rl360.weights.follow.follow_weights) and applies every new version between
generations.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve

from rl360.policies.affinity import set_niceness
from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines import build_engine_backend
from rl360.types import Generation, SamplingParams
from rl360.weights.follow import follow_weights
from rl360.weights.payloads import WeightUpdate

log = logging.getLogger("rl360.engine")

# a (re)started replica serves nothing before it has the publisher's newest weights; this
# long at most (a fetch of the largest model's weights), then its requests fail (infra errors)
CATCH_UP_TIMEOUT_S = 600.0
# a session shard's wait for one generation (the longest completion on the slowest engine);
# past it the request is cancelled and the turn fails on the infrastructure
ENGINE_CALL_TIMEOUT_S = 900.0


class EngineReplica:
    """Serve wraps this class with `serve.deployment(...)` in rl360.launch.serve_app."""

    def __init__(
        self,
        engine: EngineSection,
        model: ModelSection,
        seed: int = 0,
        publisher: tuple[str, str] | None = None,
    ) -> None:
        self.backend_name = backend = engine.backend
        set_niceness(engine.nice, "engine.nice")  # before the backend starts threads/processes
        self.backend = build_engine_backend(engine, model, seed)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:
            self.replica_id = "local"
        self._publisher_name = publisher  # (name, namespace) of the WeightPublisher actor
        self._follow: asyncio.Task[None] | None = None
        self._caught_up: asyncio.Event | None = None
        try:  # Serve runs the constructor on the replica's event loop: catch up (and open the
            asyncio.get_running_loop()  # core's channel) now, not at the first call or probe
        except RuntimeError:
            pass  # constructed outside a loop (a test): the first call starts it
        else:
            try:
                self._ensure_following()
            except Exception as e:  # the publisher not reachable yet: the next call retries
                log.warning("engine replica %s: weight sync not started yet: %r",
                            self.replica_id, e)
        log.info("engine replica %s up (backend=%s)", self.replica_id, backend)

    def _ensure_following(self) -> None:
        if self._publisher_name is None or self._follow is not None:
            return
        import ray


        name, namespace = self._publisher_name
        pub = ray.get_actor(name, namespace=namespace)
        self._caught_up = asyncio.Event()
        self._follow = asyncio.get_running_loop().create_task(
            follow_weights(pub, self.backend, self.replica_id, caught_up=self._caught_up),
            name="rl360-engine-weight-sync"
        )
        self._follow.add_done_callback(self._on_follow_done)
        if callable(getattr(self.backend, "open_channel", None)):  # engine.core_process
            task = asyncio.get_running_loop().create_task(self._open_channel(),
                                                          name="rl360-engine-core-channel")
            task.add_done_callback(self._on_follow_done)

    async def _open_channel(self) -> None:
        """Once this replica serves the published weights, session shards on its node may
        send generations straight to its engine core (rl360.serve.engines.core_process)."""
        assert self._caught_up is not None
        await self._caught_up.wait()
        path = await self.backend.open_channel()  # type: ignore[attr-defined]
        log.info("engine replica %s: core channel open at %s", self.replica_id, path)

    def _on_follow_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s task died: %r", task.get_name(), task.exception())

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        self._ensure_following()
        if self._caught_up is not None and not self._caught_up.is_set():
            try:
                await asyncio.wait_for(self._caught_up.wait(), CATCH_UP_TIMEOUT_S)
            except TimeoutError:
                raise RuntimeError(
                    f"engine replica {self.replica_id} has not caught up to the published "
                    f"weights within {CATCH_UP_TIMEOUT_S:g}s (CATCH_UP_TIMEOUT_S)") from None
        gen = await self.backend.generate(prompt_ids, sampling)
        gen.engine_replica = self.replica_id
        return gen

    async def generate_many(
        self, items: list[tuple[list[int], SamplingParams]]
    ) -> list[Generation | BaseException]:
        """Several generations in one request (a group's first turns: one Serve call instead
        of one per episode); they run concurrently on the backend, which batches them. A
        failed one comes back as its exception and fails alone."""
        return list(await asyncio.gather(*(self.generate(ids, sp) for ids, sp in items),
                                         return_exceptions=True))

    async def update_weights(self, version: int, update: WeightUpdate) -> bool:
        return await self.backend.update_weights(version, update)

    async def pause(self) -> None:
        await self.backend.pause()

    async def resume(self) -> None:
        await self.backend.resume()

    async def health(self) -> dict[str, Any]:
        refresh = getattr(self.backend, "refresh_health", None)  # a core process: ask it now
        if refresh is not None:
            await refresh()
        return {"replica": self.replica_id, "backend": self.backend_name, **self.backend.health()}

    async def check_health(self) -> None:  # Serve's own health probe
        self._ensure_following()
        if self._follow is not None and self._follow.done() and not self._follow.cancelled():
            raise RuntimeError(f"weight sync stopped: {self._follow.exception()!r}")
        h = self.backend.health()
        if not h.get("ok", True):
            raise RuntimeError(f"engine unhealthy: {h.get('error')}")
        probe = getattr(self.backend, "probe", None)  # optional: a generation probe (SGLang)
        if probe is not None:
            await probe()


class ServeEngineClient:
    """EngineClient over the engine deployment's handle (picklable: the handle is lazy)."""

    def __init__(self, app_name: str, deployment: str = "engine",
                 channels: tuple[str, str] | None = None) -> None:
        """`channels`: (name, namespace) of the WeightPublisher that lists the engine cores'
        channels (engine.core_process): a session whose replica's core runs on this node is
        served over that core's channel, not through Serve."""
        self.app_name = app_name
        self.deployment = deployment
        self.channels = channels
        self._handle: Any = None
        self._direct: Any = None  # CoreChannels, made in the process that calls

    def __getstate__(self) -> dict[str, Any]:
        return {"app_name": self.app_name, "deployment": self.deployment,
                "channels": self.channels, "_handle": None, "_direct": None}

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, route_key: str | None
    ) -> Generation:
        return await self._call("generate", route_key, prompt_ids, sampling)

    async def generate_many(
        self, items: list[tuple[list[int], SamplingParams]], route_key: str | None
    ) -> list[Generation | BaseException]:
        return await self._call("generate_many", route_key, items)

    async def _call(self, method: str, route_key: str | None, *args: Any) -> Any:
        if self.channels is not None and route_key:
            if self._direct is None:
                from rl360.serve.engines.core_client import CoreChannels

                self._direct = CoreChannels(self.channels)
            picked = await self._direct.pick(route_key)
            if picked is not None:
                return await _over_channel(method, *picked, *args)
        if self._handle is None:
            # by value: requests and answers travel over Serve's direct gRPC channel to the
            # replica instead of Ray task calls and the object store (the path Serve's
            # RAY_SERVE_THROUGHPUT_OPTIMIZED takes); about 1 ms of CPU less per call
            self._handle = serve.get_deployment_handle(
                self.deployment, app_name=self.app_name).options(_by_reference=False)
        h = self._handle.options(session_id=route_key) if route_key else self._handle
        response = getattr(h, method).remote(*args)
        try:
            return await asyncio.wait_for(_result(response), ENGINE_CALL_TIMEOUT_S)
        except TimeoutError:
            response.cancel()
            raise TimeoutError(f"engine {self.deployment!r} did not answer within "
                               f"{ENGINE_CALL_TIMEOUT_S:g}s (ENGINE_CALL_TIMEOUT_S)") from None
        except asyncio.CancelledError:  # the episode was cancelled (tail cancellation): the
            response.cancel()  # replica's generate is cancelled and the backend drops it
            raise


async def _result(response: Any) -> Any:
    return await response


async def _over_channel(method: str, replica: str, conn: Any, *args: Any) -> Any:
    """`generate` / `generate_many` over an engine core's channel (as the replica would answer:
    each generation names the replica; in generate_many each fails alone)."""
    async def one(prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        try:
            gen = await asyncio.wait_for(conn.generate(prompt_ids, sampling),
                                         ENGINE_CALL_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(f"engine replica {replica} did not answer within "
                               f"{ENGINE_CALL_TIMEOUT_S:g}s (ENGINE_CALL_TIMEOUT_S)") from None
        gen.engine_replica = replica
        return gen

    if method == "generate":
        return await one(*args)
    if method == "generate_many":
        return list(await asyncio.gather(*(one(ids, sp) for ids, sp in args[0]),
                                         return_exceptions=True))
    raise ValueError(f"no engine call {method!r} over a core's channel")
