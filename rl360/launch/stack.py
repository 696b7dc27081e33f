"""The start-up that `rl360 train`, `eval` and `serve` share: join (or start) Ray, place the
roles, start the Serve app and the search app (when [search] names an index) on one thread
while the env actors (told the search URL, so envs can give agents a `search` tool) and the
caller's `early` starts run on another; on exit stop them and remove the placement groups, in
reverse order.

    with running_stack(recipe) as stack:
        stack.serving, stack.search, stack.pool, stack.placement, stack.info["dashboard_url"]
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec

from rl360.actors.env_pool import EnvPool
from rl360.envs.registry import check_env_params
from rl360.launch.ingress import check_ingress, ingress_env
from rl360.launch.roles import place_roles
from rl360.launch.search_app import check_search, search_url, start_search, stop_search
from rl360.launch.serve_app import base_url, shard_names, start_serving, stop_serving
from rl360.launch.startup import StartupClock
from rl360.ray_session import ray_session
from rl360.recipe import Recipe, RecipeError

if TYPE_CHECKING:
    from rl360.actors.env_pool import EnvPool
    from rl360.launch.roles import Placement
    from rl360.launch.search_app import SearchHandles
    from rl360.launch.serve_app import ServingHandles

T = TypeVar("T")


@dataclass
class Stack(Generic[T]):
    info: dict[str, Any]  # ray_session's: address, dashboard_url, local
    placement: Placement
    serving: ServingHandles
    pool: EnvPool | None  # None: started without env actors
    search: SearchHandles | None = None  # None: no [search] index
    early: T | None = None  # what running_stack's `early` returned
    clock: StartupClock | None = None  # when each part came up (running_stack's marks)


def check_recipe_parts(recipe: Recipe) -> None:
    """Checks a recipe's decoding cannot make (they import envs / look at the disk): env.params
    against the env's constructor, and the [search] index. RecipeError names the key."""
    try:
        check_env_params(recipe.env.env, recipe.env.params)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None
    check_search(recipe)
    check_ingress(recipe.serve)


def service_specs(recipe: Recipe, search: SearchHandles | None = None) -> dict[str, Any]:
    """What every env gets as `Env.services`: per service the recipe runs, its URL and the
    recipe's client settings (rl360.envs.search_tool turns "search" into the agents' search
    tool). The URLs are known before the services start, so env actors can start first."""
    s = recipe.search
    if not s.index:
        return {}
    url = search.url if search is not None else search_url(recipe)
    return {"search": {"url": url, "timeout_s": s.tool_timeout_s, "default_k": s.default_k}}


def _serve_apps(recipe: Recipe, placement: Placement, clock: StartupClock,
                deployed: Future[ServingHandles]) -> tuple[ServingHandles, SearchHandles | None]:
    """The Serve apps, in order: rl360 (engines, shards, session server), then search.
    `deployed` gets the rl360 app's handles once it is deployed (its replicas may still be
    starting), or once both apps run when there is a search app (an env's search tool must
    not find its service missing)."""
    early = deployed.set_result if not recipe.search.index else None
    serving = start_serving(recipe, placement, clock=clock, deployed=early)
    try:
        search = start_search(recipe, placement)
        if search is not None:
            clock.mark("search_app")
        if not deployed.done():
            deployed.set_result(serving)
        return serving, search
    except BaseException:
        stop_serving(serving)
        raise


@contextlib.contextmanager
def running_stack(recipe: Recipe, *, env_actors: bool = True,
                  sampling: dict[str, Any] | None = None,
                  early: Callable[[Placement], T] | None = None,
                  deployed: Callable[[Stack[T]], None] | None = None,
                  clock: StartupClock | None = None) -> Iterator[Stack[T]]:
    """Ray session + placement + Serve apps (+ env actors, with `sampling` as their default).

    Start-up overlaps: the Serve apps deploy on a thread of their own (most of their time is
    Serve's controller, proxy and replica starts, waited on) while this thread starts the env
    actors (they find the shards by name, at their first episode) and runs `early(placement)`,
    the caller's own slow starts (`rl360 train`'s trainer ranks); its result is `Stack.early`.
    Then `deployed(stack)` runs as soon as the rl360 app is deployed, its engine replicas
    perhaps still loading: work started there that calls the engines waits for them
    (`rl360 train` starts its rollout there, so the first groups are at the engine when it
    comes up). Everything is up when the stack is yielded; a failure anywhere stops what did
    start. `clock` (a new one by default: `Stack.clock`) gets a mark as each part comes up."""
    import ray

    clock = clock or StartupClock()

    check_recipe_parts(recipe)  # bad env.params or [search] fail before Ray starts
    r = recipe.ray
    local = not (r.address or os.environ.get("RAY_ADDRESS", ""))
    with ray_session(r.address, r.num_cpus, r.dashboard, r.namespace,
                     env_vars=ingress_env(recipe.serve, local=local)) as info:
        clock.mark("ray")
        if info["dashboard_url"]:
            print(f"rl360: Ray dashboard at {info['dashboard_url']}", file=sys.stderr)
        placement = place_roles(recipe)
        clock.mark("placement")
        serving: ServingHandles | None = None
        pool: EnvPool | None = None
        search: SearchHandles | None = None
        apps = ThreadPoolExecutor(1, thread_name_prefix="rl360-serve-start")
        ready: Future[ServingHandles] = Future()
        started = apps.submit(_serve_apps, recipe, placement, clock, ready)
        try:
            try:
                if env_actors:
                    pool = EnvPool(recipe.env, sampling or msgspec.to_builtins(recipe.eval.sampling),
                                   shard_names(recipe), recipe.ray.namespace, base_url(recipe),
                                   placement.env_options(), services=service_specs(recipe))
                    loaded = [a.load.remote() for a in pool.actors]
                extra = early(placement) if early is not None else None
                if early is not None:
                    clock.mark("early")
                if deployed is not None:
                    wait([ready, started], return_when=FIRST_COMPLETED)
                    if ready.done():  # else the deploy failed: raised below
                        if pool is not None:
                            ray.get(loaded)
                        deployed(Stack(info=info, placement=placement, serving=ready.result(),
                                       pool=pool, early=extra, clock=clock))
            finally:  # the apps are up (or failed) before anything goes on or is torn down
                serving, search = started.result()
                apps.shutdown()
            if pool is not None:
                ray.get(loaded)  # up, or raise here
                clock.mark("env_actors")
            yield Stack(info=info, placement=placement, serving=serving, pool=pool,
                        search=search, early=extra, clock=clock)
        finally:
            if pool is not None:
                pool.shutdown()
            if search is not None:
                stop_search(search)
            if serving is not None:
                stop_serving(serving)
            placement.remove_groups()
