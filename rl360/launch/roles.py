"""Placing a run's roles on the connected Ray cluster: the one call the run paths make.

    placement = place_roles(recipe)           # inside ray_session(...)
    TrainerWorker.options(**placement.trainer_options(rank))
    serve.deployment(EngineReplica, **placement.engine_deployment_options(), ...)
    Shard.options(**placement.service_options())            # service role
    EnvActor.options(**placement.env_options())             # cluster.env_role
    placement.remove_groups()                  # at shutdown

A recipe with a `cluster` section gets a `RayPlacement` (placement.py): the plan is made from
the live nodes, the trainer placement groups are created (named `<run>-train-<i>`) and every
actor asks for its role's resource. Without one (the CPU demo) it gets `LocalPlacement`: the
same options the actors always had, left to Ray's default scheduler.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

from rl360.launch.placement import PlacementError, RayPlacement, is_cluster_recipe
from rl360.launch.plan import plan_live
from rl360.recipe import Recipe


class Placement(Protocol):
    """Ray options for each role's actors and deployments."""

    def trainer_options(self, rank: int) -> dict[str, Any]: ...

    def engine_deployment_options(self) -> dict[str, Any]: ...

    def service_options(self, num_cpus: float = 0.0) -> dict[str, Any]: ...

    def env_options(self) -> dict[str, Any]: ...

    def remove_groups(self) -> None: ...


class LocalPlacement:
    """No cluster section: the recipe's resource sizes, no role resources, no groups."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe

    def trainer_options(self, rank: int) -> dict[str, Any]:
        t = self.recipe.trainer
        return {"num_cpus": t.num_cpus, "num_gpus": t.num_gpus}

    def engine_deployment_options(self) -> dict[str, Any]:
        e = self.recipe.engine
        return {"num_replicas": e.replicas,
                "ray_actor_options": {"num_cpus": e.num_cpus, "num_gpus": e.num_gpus}}

    def service_options(self, num_cpus: float = 0.0) -> dict[str, Any]:
        return {"num_cpus": num_cpus}

    def env_options(self) -> dict[str, Any]:
        return {"num_cpus": self.recipe.env.num_cpus}

    def remove_groups(self) -> None:
        return None


def place_roles(recipe: Recipe, timeout_s: float = 300.0) -> Placement:
    """The placement for this run on the connected cluster (call inside a Ray session).

    For a cluster recipe: plans on `ray.nodes()` (PlacementError names what does not fit),
    creates the trainer placement groups and waits until Ray has placed them."""
    if not is_cluster_recipe(recipe):
        return LocalPlacement(recipe)

    plan = plan_live(recipe)
    placement = RayPlacement(plan)
    placement.create_groups(timeout_s)
    for w in plan.warnings:
        print(f"rl360: placement: {w}", file=sys.stderr)
    nodes = {i.node for i in plan.items}
    print(f"rl360: placed {len(plan.items)} actors and replicas on {len(nodes)} nodes "
          f"({len(plan.groups)} trainer placement groups: "
          f"{', '.join(g.name for g in plan.groups)}); `rl360 plan` shows the table",
          file=sys.stderr)
    return placement


__all__ = ["LocalPlacement", "Placement", "PlacementError", "place_roles"]
