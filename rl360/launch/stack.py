"""The start-up that `rl360 train`, `eval` and `serve` share: join (or start) Ray, place the
roles, start the Serve app, the search app (when [search] names an index) and the env actors
(told the search URL, so envs can give agents a `search` tool); on exit stop them and remove
the placement groups, in reverse order.

    with running_stack(recipe) as stack:
        stack.serving, stack.search, stack.pool, stack.placement, stack.info["dashboard_url"]
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from rl360.actors.env_pool import EnvPool
from rl360.envs.registry import check_env_params
from rl360.launch.ingress import check_ingress, ingress_env
from rl360.launch.roles import place_roles
from rl360.launch.search_app import check_search, start_search, stop_search
from rl360.launch.serve_app import start_serving, stop_serving
from rl360.ray_session import ray_session
from rl360.recipe import Recipe, RecipeError

if TYPE_CHECKING:
    from rl360.actors.env_pool import EnvPool
    from rl360.launch.roles import Placement
    from rl360.launch.search_app import SearchHandles
    from rl360.launch.serve_app import ServingHandles


@dataclass
class Stack:
    info: dict[str, Any]  # ray_session's: address, dashboard_url, local
    placement: Placement
    serving: ServingHandles
    pool: EnvPool | None  # None: started without env actors
    search: SearchHandles | None = None  # None: no [search] index


def check_recipe_parts(recipe: Recipe) -> None:
    """Checks a recipe's decoding cannot make (they import envs / look at the disk): env.params
    against the env's constructor, and the [search] index. RecipeError names the key."""
    try:
        check_env_params(recipe.env.env, recipe.env.params)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None
    check_search(recipe)
    check_ingress(recipe.serve)


def service_specs(recipe: Recipe, search: SearchHandles | None) -> dict[str, Any]:
    """What every env gets as `Env.services`: per running service, its URL and the recipe's
    client settings (rl360.envs.search_tool turns "search" into the agents' search tool)."""
    if search is None:
        return {}
    s = recipe.search
    return {"search": {"url": search.url, "timeout_s": s.tool_timeout_s, "default_k": s.default_k}}


@contextlib.contextmanager
def running_stack(recipe: Recipe, *, env_actors: bool = True,
                  sampling: dict[str, Any] | None = None) -> Iterator[Stack]:
    """Ray session + placement + Serve app (+ env actors, with `sampling` as their default)."""
    import ray


    check_recipe_parts(recipe)  # bad env.params or [search] fail before Ray starts
    r = recipe.ray
    local = not (r.address or os.environ.get("RAY_ADDRESS", ""))
    with ray_session(r.address, r.num_cpus, r.dashboard, r.namespace,
                     env_vars=ingress_env(recipe.serve, local=local)) as info:
        if info["dashboard_url"]:
            print(f"rl360: Ray dashboard at {info['dashboard_url']}", file=sys.stderr)
        placement = place_roles(recipe)
        serving: ServingHandles | None = None
        pool: EnvPool | None = None
        search: SearchHandles | None = None
        try:
            serving = start_serving(recipe, placement)
            search = start_search(recipe, placement)
            if env_actors:
                pool = EnvPool(recipe.env, sampling or msgspec.to_builtins(recipe.eval.sampling),
                               serving.shard_names, serving.namespace, serving.base_url,
                               placement.env_options(), services=service_specs(recipe, search))
                ray.get([a.load.remote() for a in pool.actors])  # up, or raise here
            yield Stack(info=info, placement=placement, serving=serving, pool=pool, search=search)
        finally:
            if pool is not None:
                pool.shutdown()
            if search is not None:
                stop_search(search)
            if serving is not None:
                stop_serving(serving)
            placement.remove_groups()
