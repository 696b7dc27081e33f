"""The start-up that `rl360 train`, `eval` and `serve` share: join (or start) Ray, place the
roles, start the Serve app and the env actors; on exit stop them and remove the placement
groups, in reverse order.

    with running_stack(recipe) as stack:
        stack.serving, stack.pool, stack.placement, stack.info["dashboard_url"]
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from rl360.actors.env_pool import EnvPool
from rl360.launch.roles import place_roles
from rl360.launch.serve_app import start_serving, stop_serving
from rl360.ray_session import ray_session
from rl360.recipe import Recipe

if TYPE_CHECKING:
    from rl360.actors.env_pool import EnvPool
    from rl360.launch.roles import Placement
    from rl360.launch.serve_app import ServingHandles


@dataclass
class Stack:
    info: dict[str, Any]  # ray_session's: address, dashboard_url, local
    placement: Placement
    serving: ServingHandles
    pool: EnvPool | None  # None: started without env actors


@contextlib.contextmanager
def running_stack(recipe: Recipe, *, env_actors: bool = True,
                  sampling: dict[str, Any] | None = None) -> Iterator[Stack]:
    """Ray session + placement + Serve app (+ env actors, with `sampling` as their default)."""
    import ray


    r = recipe.ray
    with ray_session(r.address, r.num_cpus, r.dashboard, r.namespace) as info:
        if info["dashboard_url"]:
            print(f"rl360: Ray dashboard at {info['dashboard_url']}", file=sys.stderr)
        placement = place_roles(recipe)
        serving: ServingHandles | None = None
        pool: EnvPool | None = None
        try:
            serving = start_serving(recipe, placement)
            if env_actors:
                pool = EnvPool(recipe.env, sampling or msgspec.to_builtins(recipe.eval.sampling),
                               serving.shard_names, serving.namespace, serving.base_url,
                               placement.env_options())
                ray.get([a.load.remote() for a in pool.actors])  # up, or raise here
            yield Stack(info=info, placement=placement, serving=serving, pool=pool)
        finally:
            if pool is not None:
                pool.shutdown()
            if serving is not None:
                stop_serving(serving)
            placement.remove_groups()
