"""The run path places every role: on a simulated multi-node cluster (one raylet per fake node,
each with fake GPUs and its role resource, as in test_placement_live.py), `running_stack` and
`start_train_actors` (what `rl360 train` calls) start the real actors: trainer ranks (tiny
torch model), engine replicas (the scripted backend), session server and shard, weight
publisher, rollout controller, trajectory buffer and env actors. The test reads from Ray's
state API where each landed, and from the placement-group table that the trainer groups were
created by name, held their ranks on one train node each, and were removed at shutdown.

Layout: service-00 (the head) + train-00, train-01 (2 fake GPUs each) + rollout-00, rollout-01.
The cluster runs in a subprocess (this file as a script), apart from the session's Ray.
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

from tests.ports import free_ports

REPO = Path(__file__).resolve().parents[2]


OVERRIDES = [
    "run.name=wired",
    "model.path=tiny", "engine.backend=scripted", "engine.replicas=2", "engine.num_gpus=1",
    "engine.num_cpus=0.5",
    "trainer.workers=3", "trainer.num_gpus=1", "trainer.device=cpu", "trainer.num_cpus=0.5",
    "env.actors=2", "env.num_cpus=0.25", "env.episodes_per_actor=4",
    "serve.proxy_location=HeadOnly",
    "cluster.service.nodes=1", "cluster.service.cpus_per_node=2",
    "cluster.train.nodes=2", "cluster.train.gpus_per_node=2", "cluster.train.cpus_per_node=2",
    "cluster.rollout.nodes=2", "cluster.rollout.gpus_per_node=2",
    "cluster.rollout.cpus_per_node=2",
]


def _live(overrides: list[str]) -> dict[str, Any]:
    """Runs in the subprocess: fake cluster, the wired start-up, where everything landed."""
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
                      RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")  # addresses stay on 127.0.0.1
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group_table
    from ray.util.state import list_actors

    from rl360.launch.placement import node_resources
    from rl360.launch.plan import declared_nodes
    from rl360.launch.stack import running_stack
    from rl360.launch.train_run import start_train_actors
    from rl360.policies.loading import resolve_model_path
    from rl360.recipe import apply_overrides, decode_recipe

    recipe = decode_recipe(apply_overrides({}, overrides))
    fake = declared_nodes(recipe)

    def args(n: Any) -> dict[str, Any]:
        return {"num_cpus": int(n.cpus or 1), "num_gpus": int(n.gpus),
                "resources": node_resources(n.roles), "node_ip_address": "127.0.0.1",
                "object_store_memory": 78 * 1024 * 1024}

    cluster = Cluster(initialize_head=True, head_node_args={
        **args(fake[0]), "include_dashboard": True, "dashboard_host": "127.0.0.1",
        "dashboard_port": free_ports()[0]})
    try:
        node_names = {cluster.head_node.node_id: fake[0].name}
        for n in fake[1:]:
            node = cluster.add_node(wait=False, **args(n))
            node_names[node.node_id] = n.name
        cluster.wait_for_nodes(timeout=300)
        os.environ["RAY_ADDRESS"] = cluster.address  # as inside `ray job submit`
        model_path = resolve_model_path(recipe.model.path)
        out: dict[str, Any] = {"nodes": node_names}
        with running_stack(recipe) as stack:
            actors = start_train_actors(recipe, stack, model_path)
            try:
                plan = stack.placement.plan  # type: ignore[attr-defined]
                node_id = {n.name: n.node_id for n in plan.nodes}
                out["plan"] = {i.name: node_names[node_id[i.node]] for i in plan.items}
                out["actors"] = [
                    {"name": a.name, "class": a.class_name, "node": node_names.get(a.node_id, a.node_id)}
                    for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
                ]
                out["groups"] = {
                    g["name"]: {"state": g["state"],
                                "nodes": sorted({node_names[x] for x in g["bundles_to_node_id"].values()})}
                    for g in placement_group_table().values()
                }
            finally:
                actors.trainer.shutdown()
        ray.init(address=cluster.address, log_to_driver=False)
        out["groups_after"] = {g["name"]: g["state"] for g in placement_group_table().values()}
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


def _run(overrides: list[str], timeout: int) -> dict[str, Any]:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_placement_wired as t; "
            "print('RESULT ' + json.dumps(t._live(json.loads(sys.argv[2]))))")
    proc = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), json.dumps(overrides)],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.ray
@pytest.mark.slow
def test_run_path_places_every_role() -> None:
    out = _run([*OVERRIDES, f"serve.port={free_ports()[0]}"], timeout=480)
    plan = out["plan"]
    where: dict[str, list[str]] = {}
    for a in out["actors"]:
        where.setdefault(a["name"] or a["class"], []).append(a["node"])
    engines = [a["node"] for a in out["actors"] if a["name"].startswith("SERVE_REPLICA::rl360#engine#")]
    servers = [a["node"] for a in out["actors"]
               if a["name"].startswith("SERVE_REPLICA::rl360#session-server#")]

    # trainer ranks: where the plan put them, packed (ranks 0-1 on one train node, 2 on the other)
    trainers = [where[f"rl360-trainer-{r}"][0] for r in range(3)]
    assert trainers == [plan[f"trainer/{r}"] for r in range(3)]
    assert all(n.startswith("train-") for n in trainers)
    assert trainers[0] == trainers[1] != trainers[2]
    # the trainer placement groups: named, one train node each, removed at shutdown
    groups = {k: v for k, v in out["groups"].items() if k.startswith("wired-train-")}
    assert {k: v["state"] for k, v in groups.items()} == {"wired-train-0": "CREATED",
                                                          "wired-train-1": "CREATED"}
    assert groups["wired-train-0"]["nodes"] == [trainers[0]]
    assert groups["wired-train-1"]["nodes"] == [trainers[2]]
    assert {out["groups_after"][k] for k in groups} == {"REMOVED"}
    # engine replicas: spread, one per rollout node
    assert sorted(engines) == ["rollout-00", "rollout-01"]
    # env actors on the env role (rollout by default)
    envs = [where[f"rl360-env-{i}"][0] for i in range(2)]
    assert all(n.startswith("rollout-") for n in envs), envs
    # service role: session server replica, shard, publisher, controller, buffer on service-00
    service = [*servers, *(where[n][0] for n in ("rl360-sessions-0", "rl360-weights",
                                                 "rl360-rollout-controller",
                                                 "rl360-trajectory-buffer"))]
    assert service == ["service-00"] * 5, service
    assert Counter(a["node"] for a in out["actors"])["service-00"] >= 5
