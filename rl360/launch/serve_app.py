"""Builds and runs the Ray Serve app "rl360": engine replicas, session shards, the ingress.

    handles = start_serving(recipe)       # inside a Ray session
    handles.base_url                      # http://127.0.0.1:8000
    await handles.publish_weights(v, state)
    stop_serving(handles)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rl360.launch.adapters import engine_for
from rl360.launch.roles import LocalPlacement
from rl360.launch.startup import StartupClock
from rl360.policies.loading import resolve_model_path
from rl360.recipe import Recipe, ServeSection
from rl360.serve.engines.replica import EngineReplica, ServeEngineClient
from rl360.serve.engines.routing import SessionAffinityRouter
from rl360.serve.sessions.auth import resolve_api_key
from rl360.serve.sessions.http import HTTP_REQUEST_TIMEOUT_S, SessionServer
from rl360.serve.sessions.shard import SessionShard
from rl360.weights.publisher import WeightPublisher

if TYPE_CHECKING:
    from rl360.launch.roles import Placement

log = logging.getLogger("rl360.serve")
# with engine.core_process, how long start-up waits for every engine core's channel (a replica
# opens it once it serves the published weights and reports it within a poll: ~2 s after
# RUNNING for the tiny model)
CHANNELS_WAIT_S = 60.0

# how often a stopping replica looks for requests still in flight; it stops once there are
# none (Serve's 2 s default, slept before the first look, was most of a stop)
DRAIN_POLL_S = 0.2

# Serve runs a replica's user code and a handle's router on event loops of their own threads
# by default; every request then crosses threads twice per hop. The session server, the engine
# replicas and the shards (whose handle reaches the engines) do little Python work per request
# and never block their loop, so they run both on the process's one loop.
SAME_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                 "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def with_env(options: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """`options` (Ray actor options) with `env` added to its runtime_env's env_vars (Ray
    merges env_vars with the job's own runtime env)."""
    renv = dict(options.get("runtime_env") or {})
    renv["env_vars"] = {**(renv.get("env_vars") or {}), **env}
    return {**options, "runtime_env": renv}


@dataclass
class ServingHandles:
    app_name: str
    base_url: str
    namespace: str
    shard_names: list[str]
    publisher_name: str
    shards: list[Any] = field(default_factory=list)
    publisher: Any = None

    def publish_weights(self, version: int, state: dict[str, Any]) -> bool:
        """Put `state` in the object store once; every engine replica applies it between
        batches. Returns False if `version` is not newer than the published one."""
        import ray

        ref = ray.put(state)
        return ray.get(self.publisher.publish.remote(version, [ref]))

    def publish_ref(self, version: int, state_ref: Any) -> bool:
        """Publish a state dict already in the object store (e.g. the trainer rank 0's)."""
        import ray

        return ray.get(self.publisher.publish.remote(version, [state_ref]))

    def weight_status(self) -> dict[str, Any]:
        import ray

        return ray.get(self.publisher.status.remote())


def shard_names(recipe: Recipe) -> list[str]:
    """The session shards' actor names (known before they start: env actors find them by name)."""
    s = recipe.serve
    return [f"{s.app_name}-sessions-{i}" for i in range(s.session_shards)]


def base_url(recipe: Recipe) -> str:
    return f"http://{recipe.serve.host}:{recipe.serve.port}"


def start_serving(recipe: Recipe, placement: Placement | None = None,
                  timeout_s: float = 300.0, clock: StartupClock | None = None,
                  deployed: Callable[[ServingHandles], None] | None = None) -> ServingHandles:
    """Engines (on `placement`'s rollout options), shards, publisher and session servers
    (service options); without a placement, Ray's default scheduler places them. `clock`
    gets marks: serve_start (controller and proxy up), serve_app (every replica RUNNING and,
    with engine.core_process, every engine core's channel open).
    `deployed` is called with the handles once the app is deployed, before its replicas run:
    calls through the engine handle from then on wait for a replica instead of failing."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig


    s, e = recipe.serve, recipe.engine
    ns = recipe.ray.namespace
    resolve_api_key(s.host, s.api_key)  # a server reachable from other machines needs a key
    placement = placement or LocalPlacement(recipe)
    service = placement.service_options()
    resolve_model_path(recipe.model.path)  # build/convert once, before replicas race for it
    publisher_name = f"{s.app_name}-weights"
    # the publisher restarts with calls in flight retried; it comes back empty and is refilled
    # by the replicas (their applied versions, within a poll) and the trainer's next publish
    publisher = (
        ray.remote(WeightPublisher)
        .options(name=publisher_name, namespace=ns, get_if_exists=True, max_restarts=-1,
                 max_task_retries=-1, **service)
        .remote()
    )
    shard_cls = ray.remote(SessionShard)
    shards = []
    names = shard_names(recipe)
    for name in names:
        shards.append(
            # a shard restarts empty: the episodes whose sessions it held fail on the
            # infrastructure and are re-run (actors/controller.py); new sessions go on at once
            shard_cls.options(name=name, namespace=ns, get_if_exists=True,
                              max_concurrency=1000, max_restarts=-1, max_task_retries=0,
                              **with_env(service, SAME_LOOP_ENV))
            .remote(recipe.model, s, recipe.run.name, ServeEngineClient(
                s.app_name, channels=(publisher_name, ns) if recipe.engine.core_process else None))
        )
    # Serve's controller, proxies and replicas start while the shards construct (tokenizer,
    # renderer); the session server finds them by name
    serve.start(http_options=http_options(s), proxy_location=s.proxy_location)
    if clock is not None:
        clock.mark("serve_start")
    engine_opts = placement.engine_deployment_options()  # num_replicas, ray_actor_options, ...
    engine_opts["ray_actor_options"] = with_env(engine_opts.get("ray_actor_options") or {},
                                                SAME_LOOP_ENV)
    engine = serve.deployment(
        EngineReplica,
        name="engine",
        max_ongoing_requests=e.max_ongoing_requests,
        **engine_opts,
        request_router_config=RequestRouterConfig(request_router_class=SessionAffinityRouter),
        health_check_period_s=5,
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
        logging_config={"enable_access_log": False},  # one line per token call is noise
    ).bind(engine_for(recipe), recipe.model, recipe.run.seed, (publisher_name, ns))
    server = serve.deployment(
        SessionServer,
        name="session-server",
        num_replicas=s.server_replicas,
        max_ongoing_requests=1000,
        ray_actor_options=with_env(service, SAME_LOOP_ENV),
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
        logging_config={"enable_access_log": False},
    ).bind(names, ns, recipe.run.name, s, engine)
    handles = ServingHandles(
        app_name=s.app_name,
        base_url=base_url(recipe),
        namespace=ns,
        shard_names=names,
        publisher_name=publisher_name,
        shards=shards,
        publisher=publisher,
    )
    try:  # deployed, then waited for: `deployed` runs in between (serve.run waits right away)
        t0 = time.monotonic()
        serve.run_many([serve.RunTarget(server, name=s.app_name, route_prefix="/")],
                       wait_for_ingress_deployment_creation=False,
                       wait_for_applications_running=False)
        if deployed is not None:
            deployed(handles)
        _wait_running(s.app_name, timeout_s - (time.monotonic() - t0))
        if e.core_process:
            _wait_channels(publisher, engine_opts.get("num_replicas"),
                           min(CHANNELS_WAIT_S, timeout_s - (time.monotonic() - t0)))
        ray.get([sh.stats.remote() for sh in shards])  # surface constructor errors here
        if clock is not None:
            clock.mark("serve_app")
    except BaseException:
        stop_serving(handles)
        raise
    return handles


def http_options(s: ServeSection) -> dict[str, Any]:
    """Serve's HTTP options: where it listens and its end-to-end request timeout (the session
    server answers a stuck shard with a 504 first; this ends what a stuck replica never
    answers). Engine replicas get no HTTP traffic: every call to them is bounded by its caller
    (ENGINE_CALL_TIMEOUT_S)."""
    return {"host": s.host, "port": s.port, "request_timeout_s": HTTP_REQUEST_TIMEOUT_S}


def _wait_channels(publisher: Any, replicas: Any, timeout_s: float) -> None:
    """With engine.core_process, until every replica's core channel is listed: a session goes
    to the rendezvous choice among the listed channels, so a replica listed late would get no
    session at first and later take over some sessions of the others (their prefixes lost).
    Past `timeout_s` the app serves anyway (the sessions of a core without a channel go
    through Serve) and logs how many cores have one."""
    if not isinstance(replicas, int) or replicas < 1:
        return
    import ray

    deadline = time.monotonic() + timeout_s
    listed: dict[str, Any] = {}
    while time.monotonic() < deadline:
        listed = ray.get(publisher.channels.remote())
        if len(listed) >= replicas:
            return
        time.sleep(0.2)
    log.warning("engine.core_process: %d of %d engine cores have an open channel after %.0fs; "
                "the other replicas' sessions go through Serve until theirs opens",
                len(listed), replicas, timeout_s)


def _wait_running(app_name: str, timeout_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        st = serve.status().applications.get(app_name)
        status = str(getattr(st, "status", "")) if st else ""
        if status.endswith("RUNNING"):
            return
        if status.endswith("DEPLOY_FAILED"):
            raise RuntimeError(f"serve app {app_name!r} failed to deploy: {st.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"serve app {app_name!r} not running after {timeout_s:.0f}s: {status}")
        time.sleep(0.2)


def stop_serving(handles: ServingHandles) -> None:
    import ray
    from ray import serve

    serve.delete(handles.app_name)
    for h in [*handles.shards, handles.publisher]:
        try:
            ray.kill(h)
        except Exception:  # already gone
            pass
