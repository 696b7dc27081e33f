"""place_roles: a recipe without a cluster section keeps the actors' own sizes and Ray's default
scheduler; a cluster recipe on nodes without role resources is refused in one line."""

from __future__ import annotations

import pytest

from rl360.launch.placement import PlacementError
from rl360.launch.roles import LocalPlacement, place_roles
from rl360.recipe import apply_overrides, decode_recipe


def test_local_recipe_keeps_sizes_and_asks_for_no_roles() -> None:
    recipe = decode_recipe(apply_overrides({}, [
        "trainer.num_cpus=1.5", "trainer.num_gpus=0", "engine.replicas=3", "engine.num_cpus=0.5",
        "env.num_cpus=0.25"]))
    p = place_roles(recipe)  # no Ray needed: nothing is planned or created
    assert isinstance(p, LocalPlacement)
    assert p.trainer_options(0) == {"num_cpus": 1.5, "num_gpus": 0.0}
    assert p.engine_deployment_options() == {
        "num_replicas": 3, "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0.0}}
    assert p.service_options() == {"num_cpus": 0.0}
    assert p.env_options() == {"num_cpus": 0.25}
    p.remove_groups()


@pytest.mark.ray
def test_cluster_recipe_on_untagged_nodes_is_refused(ray_cluster: None) -> None:
    recipe = decode_recipe(apply_overrides({}, [
        "cluster.service.nodes=1", "cluster.train.nodes=1", "cluster.rollout.nodes=1"]))
    with pytest.raises(PlacementError, match="rl360_role_"):
        place_roles(recipe)


@pytest.mark.ray
def test_groups_are_created_once_by_name(ray_cluster: None) -> None:
    from ray.util.placement_group import get_placement_group

    from rl360.launch.placement import GroupSpec, Plan, RayPlacement

    group = GroupSpec(name="rolestest-train-0", role="train", strategy="STRICT_PACK", node="local",
                      bundles=[{"CPU": 0.001}])
    plan = Plan(mode="local", source="test", nodes=[], items=[], groups=[group])
    first = RayPlacement(plan)
    first.create_groups(timeout_s=60)
    try:  # a second run of the same name on the same cluster is refused, the first keeps its group
        with pytest.raises(PlacementError, match=r"rolestest-train-0.*already exists"):
            RayPlacement(plan).create_groups(timeout_s=60)
        assert get_placement_group("rolestest-train-0") is not None
    finally:
        first.remove_groups()
    again = RayPlacement(plan)  # removed groups free their names
    again.create_groups(timeout_s=60)
    again.remove_groups()
