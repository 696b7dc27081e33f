"""Placement on a real (simulated) multi-node Ray cluster on one machine.

`ray.cluster_utils.Cluster` starts one raylet per fake node, each with fake GPUs and its role
resource (as the Slurm template starts real nodes). The plan is made from `ray.nodes()`,
turned into Ray options by RayPlacement, and the test checks where Ray actually put the
trainer placement groups and ranks, the engine replicas (a Serve deployment) and the service
actors. The cluster runs in a subprocess (this file run as a script) so it never meets the
session's own `ray_cluster`.

Default layout: 1 service + 2 train + 3 rollout nodes (~45 s here). The full 33-node layout
takes ~70 s and ~1 GB for the raylets alone on 2 cores, so it only runs with
RL360_TEST_33_NODES=1; the pure planner checks the full layout in test_placement_plan.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

SMALL = [
    "cluster.service.nodes=1", "cluster.service.cpus_per_node=2",
    "cluster.train.nodes=2", "cluster.train.gpus_per_node=2", "cluster.train.cpus_per_node=2",
    "cluster.rollout.nodes=3", "cluster.rollout.gpus_per_node=4",
    "cluster.rollout.cpus_per_node=2",
    "trainer.workers=4", "trainer.num_gpus=1", "trainer.num_cpus=0.5",
    "engine.replicas=3", "engine.num_gpus=2", "engine.tensor_parallel=2", "engine.num_cpus=0.5",
    "serve.session_shards=2",
]


def _live(overrides: list[str], engine_probe: bool) -> dict[str, Any]:
    """Runs in the subprocess: fake cluster, plan, place, report where everything landed."""
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
                      RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")  # stay on 127.0.0.1
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group_table

    from rl360.launch.placement import RayPlacement, node_resources, plan_placement
    from rl360.launch.plan import declared_nodes, nodes_from_ray
    from rl360.recipe import apply_overrides, decode_recipe

    recipe = decode_recipe(apply_overrides({}, overrides))
    fake = declared_nodes(recipe)

    def args(n: Any) -> dict[str, Any]:
        return {"num_cpus": int(n.cpus or 1), "num_gpus": int(n.gpus),
                "resources": node_resources(n.roles), "node_ip_address": "127.0.0.1",
                "object_store_memory": 78 * 1024 * 1024}

    cluster = Cluster(initialize_head=True,
                      head_node_args={**args(fake[0]), "include_dashboard": False})
    try:
        for n in fake[1:]:
            cluster.add_node(wait=False, **args(n))
        cluster.wait_for_nodes(timeout=300)
        ray.init(address=cluster.address, log_to_driver=False, namespace="rl360-placement")
        nodes = nodes_from_ray(ray.nodes())
        plan = plan_placement(recipe, nodes, "fake cluster")
        name_of = {n.node_id: n.name for n in nodes}
        role_of = {n.name: n.roles for n in nodes}
        rp = RayPlacement(plan)
        groups = rp.create_groups()
        pg_nodes = {
            name: sorted({name_of[x] for x in placement_group_table(pg)["bundles_to_node_id"].values()})
            for name, pg in groups.items()
        }
        out: dict[str, Any] = {
            "roles": role_of,
            "plan": {i.name: i.node for i in plan.items},
            "pg_nodes": pg_nodes,
            "pg_planned": {g.name: g.node for g in plan.groups},
            "replicas_per_node": plan.engine_replicas_per_node,
        }
        if not engine_probe:  # big layouts: placement groups only (no worker processes)
            return out

        @ray.remote(num_cpus=0)
        class Probe:
            def __init__(self) -> None:
                self.seen: list[str] = []

            def where(self) -> str:
                return ray.get_runtime_context().get_node_id()

            def add(self, node_id: str) -> None:
                self.seen.append(node_id)

            def all(self) -> list[str]:
                return self.seen

        trainers = [Probe.options(**rp.trainer_options(r)).remote()
                    for r in range(recipe.trainer.workers)]
        registry = Probe.options(name="registry", **rp.service_options()).remote()
        out["trainer"] = [name_of[x] for x in ray.get([t.where.remote() for t in trainers])]
        out["service"] = [name_of[ray.get(registry.where.remote())]]

        from ray import serve

        class EngineProbe:
            def __init__(self) -> None:
                reg = ray.get_actor("registry", namespace="rl360-placement")
                ray.get(reg.add.remote(ray.get_runtime_context().get_node_id()))

            def __call__(self) -> str:
                return "ok"

        serve.start(proxy_location="Disabled")
        opts = rp.engine_deployment_options()
        out["engine_options"] = {k: v for k, v in opts.items() if k != "ray_actor_options"}
        out["engine_options"]["ray_actor_options"] = opts["ray_actor_options"]
        serve.run(serve.deployment(EngineProbe, name="engine", **opts).bind(),
                  name="placement-probe", route_prefix=None)
        out["engine"] = [name_of[x] for x in ray.get(registry.all.remote())]
        serve.shutdown()
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


def _run(overrides: list[str], engine_probe: bool, timeout: int) -> dict[str, Any]:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_placement_live as t; "
            "print('RESULT ' + json.dumps(t._live(json.loads(sys.argv[2]), sys.argv[3] == '1')))")
    proc = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), json.dumps(overrides),
         "1" if engine_probe else "0"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


def _check_groups(out: dict[str, Any]) -> None:
    for name, where in out["pg_nodes"].items():
        assert len(where) == 1, f"{name} spans nodes {where}"  # STRICT_PACK
        assert "train" in out["roles"][where[0]]
        assert where[0] == out["pg_planned"][name]  # the soft target node of the plan
    assert len({w[0] for w in out["pg_nodes"].values()}) == len(out["pg_nodes"])


@pytest.mark.ray
@pytest.mark.slow
def test_roles_land_on_their_nodes_small_cluster() -> None:
    out = _run(SMALL, engine_probe=True, timeout=300)
    roles = out["roles"]
    _check_groups(out)
    assert len(out["pg_nodes"]) == 2
    # trainer ranks: on train nodes, 2 per node, exactly where the plan put them
    assert all("train" in roles[n] for n in out["trainer"])
    assert out["trainer"] == [out["plan"][f"trainer/{r}"] for r in range(4)]
    assert sorted(Counter(out["trainer"]).values()) == [2, 2]
    # engine replicas: one per rollout node (spread), 2 fake GPUs each
    assert out["replicas_per_node"] == 1
    assert out["engine_options"]["max_replicas_per_node"] == 1
    assert out["engine_options"]["ray_actor_options"]["resources"] == {"rl360_role_rollout": 0.001}
    assert len(out["engine"]) == 3 and all("rollout" in roles[n] for n in out["engine"])
    assert len(set(out["engine"])) == 3
    # service actors on the service node (the head)
    assert all("service" in roles[n] for n in out["service"])


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("RL360_TEST_33_NODES") != "1",
                    reason="opt-in scale test: RL360_TEST_33_NODES=1 (33 raylets take ~70 s "
                    "and ~1 GB)")
def test_reference_33_node_layout_live() -> None:
    overrides = ["cluster.service.nodes=1", "cluster.train.nodes=8", "cluster.rollout.nodes=24",
                 "trainer.workers=64", "trainer.num_gpus=1", "trainer.num_cpus=0",
                 "engine.replicas=96", "engine.num_gpus=2", "engine.num_cpus=0"]
    for role in ("service", "train", "rollout"):
        overrides += [f"cluster.{role}.gpus_per_node=8", f"cluster.{role}.cpus_per_node=1"]
    out = _run(overrides, engine_probe=False, timeout=600)
    _check_groups(out)
    assert len(out["pg_nodes"]) == 8
    assert sum(1 for r in out["roles"].values() if "rollout" in r) == 24
    assert out["replicas_per_node"] == 4
