"""The pure planner: the reference 33-node layout, the CPU demo, clear failures, `rl360 plan`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from rl360.launch.placement import (
    ROLE_UNIT,
    NodeInfo,
    PlacementError,
    node_resources,
    plan_placement,
)
from rl360.launch.plan import declared_nodes, local_node, nodes_from_ray, parse_nodes_spec
from rl360.recipe import Recipe, apply_overrides, decode_recipe, load_recipe

REPO = Path(__file__).resolve().parents[2]
DENSE = REPO / "recipes" / "gpu-dense-8b.toml"
MOE = REPO / "recipes" / "gpu-moe-30b-a3b.toml"


def _recipe(*overrides: str) -> Recipe:
    return decode_recipe(apply_overrides({}, list(overrides)))


def _by(plan, prefix: str) -> Counter[str]:  # type: ignore[no-untyped-def]
    return Counter(i.node for i in plan.of(prefix))


def test_reference_33_node_layout() -> None:
    recipe = load_recipe(DENSE)
    nodes = declared_nodes(recipe)
    assert Counter(n.roles[0] for n in nodes) == {"service": 1, "train": 8, "rollout": 24}
    assert [n.name for n in nodes if n.head] == ["service-00"]
    plan = plan_placement(recipe, nodes)
    assert plan.mode == "cluster" and not plan.warnings
    role = {n.name: n.roles[0] for n in nodes}
    # trainer: 64 ranks packed 8 per train node, one STRICT_PACK group per node, in rank order
    trainers = plan.of("trainer")
    assert len(trainers) == 64 and {role[t.node] for t in trainers} == {"train"}
    assert set(_by(plan, "trainer").values()) == {8}
    assert [t.node for t in trainers[:9]] == ["train-00"] * 8 + ["train-01"]
    assert len(plan.groups) == 8
    for g in plan.groups:
        assert g.strategy == "STRICT_PACK" and len(g.bundles) == 8
        assert g.bundles[0] == {"CPU": 8.0, "GPU": 1.0, "rl360_role_train": ROLE_UNIT}
    # engines: 96 replicas of 2 GPUs spread 4 per rollout node (round robin), GPUs all used
    engines = plan.of("engine")
    assert len(engines) == 96 and {role[e.node] for e in engines} == {"rollout"}
    assert set(_by(plan, "engine").values()) == {4}
    assert [e.node for e in engines[:2]] == ["rollout-00", "rollout-01"]
    assert plan.engine_replicas_per_node == 4
    for n in nodes:
        on = plan.on(n.name)
        assert sum(i.gpus for i in on) <= n.gpus and sum(i.cpus for i in on) <= (n.cpus or 0)
    assert sum(i.gpus for i in plan.items) == 64 + 192
    # env actors use the rollout nodes' spare CPUs; control actors sit on the service node
    assert {role[e.node] for e in plan.of("env")} == {"rollout"}
    service = [i for i in plan.items if i.role == "service"]
    assert {i.node for i in service} == {"service-00"}
    assert {i.name.split("/")[0] for i in service} >= {
        "session-server", "session-shard", "weight-publisher", "rollout-controller",
        "trajectory-buffer"}


def test_moe_recipe_plans_with_expert_parallel() -> None:
    recipe = load_recipe(MOE)
    assert recipe.engine.expert_parallel == 4 and recipe.trainer.megatron.expert_parallel == 1
    plan = plan_placement(recipe, declared_nodes(recipe))
    assert set(_by(plan, "engine").values()) == {2}  # 48 replicas x 4 GPUs over 24 nodes
    assert plan.engine_replicas_per_node == 2


def test_cpu_demo_plans_on_one_local_node() -> None:
    recipe = load_recipe(REPO / "recipes" / "cpu-demo.toml")
    plan = plan_placement(recipe, local_node(2))
    assert plan.mode == "local" and {i.node for i in plan.items} == {"local"}
    assert plan.engine_replicas_per_node == 0  # no Serve cap on one node
    assert "rl360_role_train" not in plan.groups[0].bundles[0]  # no role resources locally


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.rollout.nodes=20"],
         "rollout: needs 24 nodes x 8 GPUs for 96 engine replicas of 2 GPUs, cluster has 20 "
         "rollout nodes (20 x 8 GPUs, 96 CPUs): 80 fit"),
        (["cluster.train.nodes=6"],
         "train: needs 8 nodes x 8 GPUs for 64 trainer ranks of 1 GPU, cluster has 6 train "
         "nodes (6 x 8 GPUs, 96 CPUs): 48 fit"),
        (["engine.num_gpus=16", "engine.tensor_parallel=16"],
         "rollout: one of 96 engine replicas needs 16 GPUs on one node"),
        (["trainer.num_cpus=64"], "train: needs 4096 CPUs for 64 trainer ranks of 64 CPUs, cluster has 8 train nodes "
                                   "(8 x 8 GPUs, 96 CPUs): 8 fit"),
        (["engine.tensor_parallel=4"], "engine.num_gpus (2) must be at least "
                                       "engine.tensor_parallel (4)"),
        (["trainer.backend='megatron'", "trainer.megatron.tensor_parallel=3"], "trainer.workers (64) must be a multiple of"),
        (["trainer.backend='megatron'", "trainer.megatron.tensor_parallel=4",
          "trainer.megatron.expert_parallel=32"], "trainer.megatron.expert_parallel (32) must divide"),
        (["cluster.service.nodes=0"], "cluster.service.nodes: a multi-node recipe needs"),
    ],
)
def test_cluster_too_small_fails_in_one_line(overrides: list[str], message: str) -> None:
    recipe = load_recipe(DENSE, overrides)
    with pytest.raises(PlacementError) as err:
        plan_placement(recipe, declared_nodes(recipe))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_untagged_live_nodes_fail_with_the_fix() -> None:
    recipe = load_recipe(DENSE)
    nodes = [NodeInfo(name=f"n{i}", cpus=96, gpus=8) for i in range(33)]
    with pytest.raises(PlacementError, match="no rl360_role_"):
        plan_placement(recipe, nodes)


def test_nodes_spec_and_mismatch_warnings() -> None:
    nodes = parse_nodes_spec("service=1x8,train=8x8:96,rollout=26x8:96")
    assert len(nodes) == 35 and nodes[0].head and nodes[0].cpus is None
    plan = plan_placement(load_recipe(DENSE), nodes)
    assert "rollout: the recipe declares 24 nodes, the cluster has 26" in plan.warnings
    assert set(_by(plan, "engine").values()) <= {3, 4}  # spread over all 26
    with pytest.raises(PlacementError, match="ROLE=COUNTxGPUS"):
        parse_nodes_spec("gpu=8")


def test_nodes_from_ray_reads_roles_and_head() -> None:
    raw = [
        {"NodeID": "a" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.1",
         "NodeManagerHostname": "h1",
         "Resources": {"CPU": 96.0, "GPU": 8.0, "node:__internal_head__": 1.0,
                       **node_resources(["service"])}},
        {"NodeID": "b" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.2",
         "NodeManagerHostname": "h1", "Resources": {"CPU": 96.0, "GPU": 8.0,
                                                    **node_resources(["train", "rollout"])}},
        {"NodeID": "c" * 56, "Alive": False, "Resources": {}},
    ]
    nodes = nodes_from_ray(raw)
    assert [n.roles for n in nodes] == [["service"], ["train", "rollout"]]
    assert nodes[0].head and not nodes[1].head
    assert len({n.name for n in nodes}) == 2  # same hostname: names made unique


def test_shared_node_roles_share_capacity() -> None:
    overrides = ["cluster.service.nodes=1", "cluster.train.nodes=1", "cluster.rollout.nodes=1",
                 "trainer.workers=4", "trainer.num_gpus=1", "engine.num_gpus=2"]
    node = NodeInfo(name="box", roles=["service", "train", "rollout"], cpus=64, gpus=8)
    with pytest.raises(PlacementError, match=r"rollout: needs 6 GPUs for 3 engine replicas of 2 "
                       r"GPUs, .*: 2 fit \(other roles on these nodes use the rest\)"):
        plan_placement(_recipe(*overrides, "engine.replicas=3"), [node])  # 4 GPUs left: 2 fit
    plan = plan_placement(_recipe(*overrides, "engine.replicas=2"), [node])
    assert sum(i.gpus for i in plan.items) == 8


def test_rl360_plan_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from rl360.cli import main

    assert main(["plan", str(DENSE)]) == 0
    out = capsys.readouterr().out
    assert "planned on the recipe's cluster section (simulated, 33 nodes)" in out
    assert "train-07    train        64/96      8/8  trainer ranks 56-63" in out
    assert "rollout-23  rollout" in out and "engine replicas 23,47,71,95" in out
    assert "max_replicas_per_node=4" in out
    assert main(["plan", str(DENSE), "--set", "cluster.rollout.nodes=20"]) == 2
    assert "rl360 plan: rollout: needs 24 nodes" in capsys.readouterr().err
    assert main(["plan", str(DENSE), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mode"] == "cluster" and len(data["nodes"]) == 33


def test_plan_imports_no_ray_without_a_live_cluster() -> None:
    code = ("import sys, io, contextlib\nfrom rl360.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main(['plan', {str(DENSE)!r}])\n"
            "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))")
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"
