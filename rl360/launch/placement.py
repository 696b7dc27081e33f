"""Where every role lands: a pure planner from the recipe and a node list, and the Ray options
that make Ray place things the way the plan says.

Roles are node groups: `service` (the Ray head: Serve controller, session servers, session
shards, weight publisher, rollout controller, trajectory buffer), `train` (trainer ranks) and
`rollout` (engine replicas, and the env actors with their sandboxes unless
`cluster.env_role = "service"`). On a multi-node cluster each node advertises its role as a Ray custom resource
(`rl360_role_train: 1000`, see `node_resources`); everything placed on a role asks for a sliver
of it (`ROLE_UNIT`), so it can only land on nodes of that role. A recipe without a `cluster`
section is a local plan: every role may use every node and nothing asks for role resources.

- trainer ranks are packed per node: one STRICT_PACK placement group per node, one bundle a rank;
- engine replicas (a Serve deployment) are spread over the rollout nodes: each replica holds all
  GPUs of its tensor-parallel group on one node, and Serve's `max_replicas_per_node` caps each
  node at the plan's count (Serve replicas cannot join a user placement group, so the spread is
  enforced through Serve, not through a SPREAD group).

`plan_placement` imports nothing heavy; `RayPlacement` imports ray inside its methods.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Literal

import msgspec

from rl360.recipe import Recipe

ROLES = ("service", "train", "rollout")
ROLE_CAPACITY = 1000.0  # what a node of a role advertises
ROLE_UNIT = 0.001  # what each actor / bundle of that role asks for

Role = Literal["service", "train", "rollout"]


def role_resource(role: str) -> str:
    return f"rl360_role_{role}"


def node_resources(roles: list[str] | tuple[str, ...]) -> dict[str, float]:
    """The custom resources a node of these roles is started with (`ray start --resources`)."""
    return {role_resource(r): ROLE_CAPACITY for r in roles}


class PlacementError(ValueError):
    """The cluster cannot hold the recipe; one line naming the role and what it is short of."""


class NodeInfo(msgspec.Struct, kw_only=True):
    name: str
    roles: list[str] = msgspec.field(default_factory=list)  # [] = untagged
    cpus: float | None = None  # None: not declared, CPUs are not checked
    gpus: float = 0.0
    node_id: str = ""  # the Ray node id (hex) on a live cluster
    ip: str = ""
    head: bool = False  # the Ray head (GCS, dashboard, Serve controller, the driver)


class Item(msgspec.Struct, kw_only=True):
    """One actor or deployment replica and the node it lands on."""

    name: str  # "trainer/3", "engine/12", "session-server/0" ...
    kind: Literal["actor", "replica"]
    role: str
    node: str
    cpus: float
    gpus: float
    group: str = ""  # placement group name, "" when none
    bundle: int = -1


class GroupSpec(msgspec.Struct, kw_only=True):
    """A placement group: bundles that must land together on `node`."""

    name: str
    role: str
    strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]
    node: str
    bundles: list[dict[str, float]]


class Plan(msgspec.Struct, kw_only=True):
    mode: Literal["local", "cluster"]
    source: str  # where the node list came from
    nodes: list[NodeInfo]
    items: list[Item]
    groups: list[GroupSpec]
    engine_replicas_per_node: int = 0  # Serve max_replicas_per_node; 0 = no cap
    warnings: list[str] = msgspec.field(default_factory=list)

    def on(self, node: str) -> list[Item]:
        return [i for i in self.items if i.node == node]

    def of(self, prefix: str) -> list[Item]:
        return [i for i in self.items if i.name.split("/")[0] == prefix]


# ---------------------------------------------------------------------------- planning


def is_cluster_recipe(recipe: Recipe) -> bool:
    c = recipe.cluster
    return any(getattr(c, r).nodes > 0 for r in ROLES)




class _Free:
    """Free CPUs and GPUs per node while the planner hands them out."""

    def __init__(self, nodes: list[NodeInfo]) -> None:
        self.cpu = {n.name: n.cpus for n in nodes}
        self.gpu = {n.name: n.gpus for n in nodes}

    def fits(self, node: str, cpus: float, gpus: float) -> int:
        """How many items of this shape still fit on `node` (a large number when unbounded)."""
        counts = [10**6]
        if gpus > 0:
            counts.append(int(self.gpu[node] / gpus + 1e-9))
        c = self.cpu[node]
        if cpus > 0 and c is not None:
            counts.append(int(c / cpus + 1e-9))
        return min(counts)

    def take(self, node: str, cpus: float, gpus: float) -> None:
        self.gpu[node] -= gpus
        if self.cpu[node] is not None:
            self.cpu[node] = self.cpu[node] - cpus  # type: ignore[operator]


def plural(n: float, word: str) -> str:
    return f"{n:g} {word}" if n == 1 else f"{n:g} {word}s"


def _describe(nodes: list[NodeInfo]) -> str:
    groups = Counter((n.gpus, n.cpus) for n in nodes)
    parts = []
    for (g, c), k in groups.items():
        cpu = f", {plural(c, 'CPU')}" if c is not None else ""
        parts.append(f"{k} x {plural(g, 'GPU')}{cpu}")
    return " + ".join(parts)


def _short(role: str, label: str, count: int, cpus: float, gpus: float,
           nodes: list[NodeInfo], fit: int, mode: str) -> PlacementError:
    if not nodes:
        tag = "" if mode == "local" else f" (none carries {role_resource(role)})"
        return PlacementError(f"{role}: needs nodes for {count} {label}, cluster has no {role} nodes{tag}")
    if mode == "local":
        have = f"the {plural(len(nodes), 'node')} ({_describe(nodes)}) shared by all roles"
    else:
        have = f"cluster has {len(nodes)} {role} nodes ({_describe(nodes)})"
    big = 10**9
    gpu_fit = sum(int(n.gpus / gpus + 1e-9) for n in nodes) if gpus > 0 else big
    cpu_fit = (sum(int(n.cpus / cpus + 1e-9) for n in nodes if n.cpus is not None)
               if cpus > 0 and all(n.cpus is not None for n in nodes) else big)
    if gpus > 0 and gpu_fit <= cpu_fit:
        per = max(n.gpus for n in nodes)
        each = int(per / gpus + 1e-9)
        if each == 0:
            return PlacementError(
                f"{role}: one of {count} {label} needs {plural(gpus, 'GPU')} on one node, {have}"
            )
        need = math.ceil(count / each)
        shared = need <= len(nodes)
        what = (f"{plural(count * gpus, 'GPU')} for {count} {label} of {plural(gpus, 'GPU')}"
                if shared else
                f"{need} nodes x {plural(per, 'GPU')} for {count} {label} of {plural(gpus, 'GPU')}")
    else:
        shared = cpu_fit >= count
        what = f"{plural(count * cpus, 'CPU')} for {count} {label} of {plural(cpus, 'CPU')}"
    tail = " (other roles on these nodes use the rest)" if shared else ""
    return PlacementError(f"{role}: needs {what}, {have}: {fit} fit{tail}")


def _assign(role: str, label: str, count: int, cpus: float, gpus: float,
            nodes: list[NodeInfo], free: _Free, spread: bool, mode: str, align: int = 1) -> list[str]:
    """The node of each of `count` items: packed (fill a node, then the next) or spread
    (always the node with the fewest so far). `align`: packed counts per node are kept a
    multiple of it (tensor-parallel groups never straddle nodes)."""
    fits = {n.name: free.fits(n.name, cpus, gpus) for n in nodes}
    if align > 1:
        fits = {k: v - v % align if v >= align else v for k, v in fits.items()}
    total = sum(fits.values())
    if total < count:
        raise _short(role, label, count, cpus, gpus, nodes, total, mode)
    out: list[str] = []
    if spread:
        used = Counter[str]()
        order = [n.name for n in nodes]
        for _ in range(count):
            name = min((x for x in order if used[x] < fits[x]), key=lambda x: used[x])
            used[name] += 1
            out.append(name)
    else:
        for n in nodes:
            k = min(fits[n.name], count - len(out))
            out.extend([n.name] * k)
            if len(out) == count:
                break
    for name in out:
        free.take(name, cpus, gpus)
    return out


def _check_parallelism(recipe: Recipe) -> list[str]:
    """Megatron and engine parallel sizes that cannot work, as errors; odd ones as warnings."""
    t, e = recipe.trainer, recipe.engine
    warnings: list[str] = []
    if t.backend == "megatron":
        mp = t.megatron.tensor_parallel * t.megatron.pipeline_parallel * t.megatron.context_parallel
        if t.workers % mp:
            raise PlacementError(
                f"trainer.workers ({t.workers}) must be a multiple of tensor_parallel x "
                f"pipeline_parallel x context_parallel ({mp})"
            )
        dp_cp = t.workers // (t.megatron.tensor_parallel * t.megatron.pipeline_parallel)
        if dp_cp % t.megatron.expert_parallel:
            raise PlacementError(
                f"trainer.megatron.expert_parallel ({t.megatron.expert_parallel}) must divide data x context "
                f"parallel ({dp_cp} = workers / (tensor_parallel x pipeline_parallel))"
            )
    # other backends' parallel sizes: refused by rl360.launch.support (their declarations)
    if e.num_gpus > 0 and e.num_gpus < e.tensor_parallel:
        raise PlacementError(
            f"engine.num_gpus ({e.num_gpus:g}) must be at least engine.tensor_parallel "
            f"({e.tensor_parallel}): a replica holds its whole tensor-parallel group"
        )
    if e.tensor_parallel > 1 and e.num_gpus == 0:
        raise PlacementError(
            f"engine.tensor_parallel={e.tensor_parallel} needs GPUs: set engine.num_gpus "
            f"= {e.tensor_parallel}"
        )
    return warnings


def service_items(recipe: Recipe) -> list[tuple[str, int, float]]:
    """(name, count, cpus) of the actors on the service role, besides the Ray head's own
    processes (GCS, dashboard, Serve controller and proxy, the driver with its metrics sink)."""
    s = recipe.serve
    return [
        ("session-server", s.server_replicas, 0.0),
        ("session-shard", s.session_shards, 0.0),
        ("weight-publisher", 1, 0.0),
        ("rollout-controller", 1, 0.0),
        ("trajectory-buffer", 1, 0.0),
    ]


def plan_placement(recipe: Recipe, nodes: list[NodeInfo], source: str = "") -> Plan:
    """What lands where, with which resources; raises PlacementError when it cannot fit."""
    mode: Literal["local", "cluster"] = "cluster" if is_cluster_recipe(recipe) else "local"
    warnings = _check_parallelism(recipe)
    if not nodes:
        raise PlacementError("no nodes to plan on")
    by_role: dict[str, list[NodeInfo]] = {}
    for role in ROLES:
        if mode == "local":
            by_role[role] = list(nodes)
            continue
        if getattr(recipe.cluster, role).nodes == 0:
            raise PlacementError(
                f"cluster.{role}.nodes: a multi-node recipe needs at least 1 {role} node"
            )
        by_role[role] = [n for n in nodes if role in n.roles]
        declared = getattr(recipe.cluster, role)
        have = by_role[role]
        if have and len(have) != declared.nodes:
            warnings.append(f"{role}: the recipe declares {declared.nodes} nodes, the cluster has {len(have)}")
        if have and declared.gpus_per_node and any(n.gpus < declared.gpus_per_node for n in have):
            warnings.append(
                f"{role}: the recipe declares {declared.gpus_per_node} GPUs per node, some "
                f"nodes have fewer ({_describe(have)})"
            )
    if mode == "cluster" and not any(n.roles for n in nodes):
        raise PlacementError(
            "the cluster's nodes carry no rl360_role_* resources: start each node with "
            "`ray start --resources '{\"rl360_role_train\": 1000}'` (its role), as the Slurm "
            "template does"
        )
    free = _Free(nodes)
    items: list[Item] = []
    groups: list[GroupSpec] = []

    def unit(role: str) -> dict[str, float]:
        return {role_resource(role): ROLE_UNIT} if mode == "cluster" else {}

    t, e = recipe.trainer, recipe.engine
    align = t.megatron.tensor_parallel if t.backend == "megatron" else 1
    ranks = _assign("train", "trainer ranks", t.workers, t.num_cpus, t.num_gpus,
                    by_role["train"], free, spread=False, mode=mode, align=align)
    per_node: dict[str, list[int]] = {}
    for rank, node in enumerate(ranks):
        per_node.setdefault(node, []).append(rank)
    for gi, (node, rs) in enumerate(per_node.items()):
        gname = f"{recipe.run.name}-train-{gi}"
        bundle = {k: v for k, v in {"CPU": t.num_cpus, "GPU": t.num_gpus, **unit("train")}.items()
                  if v} or {"CPU": ROLE_UNIT}  # Ray refuses empty bundles
        groups.append(GroupSpec(name=gname, role="train", strategy="STRICT_PACK", node=node,
                                bundles=[dict(bundle) for _ in rs]))
        for bi, rank in enumerate(rs):
            items.append(Item(name=f"trainer/{rank}", kind="actor", role="train", node=node,
                              cpus=t.num_cpus, gpus=t.num_gpus, group=gname, bundle=bi))
    if t.backend == "megatron" and t.megatron.tensor_parallel > 1:
        gpn = max((n.gpus for n in by_role["train"]), default=0)
        if t.num_gpus and gpn and t.megatron.tensor_parallel * t.num_gpus > gpn:
            warnings.append(f"trainer.megatron.tensor_parallel={t.megatron.tensor_parallel} spans nodes ({gpn:g} GPUs per node)")

    replicas = _assign("rollout", "engine replicas", e.replicas, e.num_cpus, e.num_gpus,
                       by_role["rollout"], free, spread=True, mode=mode)
    for i, node in enumerate(replicas):
        items.append(Item(name=f"engine/{i}", kind="replica", role="rollout", node=node,
                          cpus=e.num_cpus, gpus=e.num_gpus))
    per_engine_node = Counter(replicas)
    cap = max(per_engine_node.values()) if mode == "cluster" else 0

    env_role = recipe.cluster.env_role
    for name, count, cpus in [*service_items(recipe), ("env", recipe.env.actors, recipe.env.num_cpus)]:
        role = env_role if name == "env" else "service"
        where = _assign(role, "env actors" if name == "env" else name, count, cpus, 0.0,
                        by_role[role], free, spread=True, mode=mode)
        kind: Literal["actor", "replica"] = "replica" if name == "session-server" else "actor"
        for i, node in enumerate(where):
            items.append(Item(name=f"{name}/{i}", kind=kind, role=role, node=node,
                              cpus=cpus, gpus=0.0))
    return Plan(mode=mode, source=source, nodes=list(nodes), items=items, groups=groups,
                engine_replicas_per_node=min(cap, 100), warnings=warnings)


# ---------------------------------------------------------------------------- Ray options


class RayPlacement:
    """Turns a Plan into Ray placement groups and actor / deployment options.

        rp = RayPlacement(plan_live(recipe))     # plan.plan_live, inside ray_session(...)
        rp.create_groups()                       # trainer placement groups, waits until placed
        Trainer.options(**rp.trainer_options(rank)).remote(...)
        serve.deployment(Engine, **rp.engine_deployment_options(), ...)
        Shard.options(**rp.service_options()).remote(...)
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.groups: dict[str, Any] = {}
        self._node_ids = {n.name: n.node_id for n in plan.nodes}

    def _role(self, role: str) -> dict[str, float]:
        return {role_resource(role): ROLE_UNIT} if self.plan.mode == "cluster" else {}

    def create_groups(self, timeout_s: float = 120.0) -> dict[str, Any]:
        import ray
        from ray.util.placement_group import get_placement_group, placement_group

        for g in self.plan.groups:
            try:
                get_placement_group(g.name)
            except ValueError:
                pass  # not there: ours to create
            else:
                self.remove_groups()
                raise PlacementError(
                    f"placement group {g.name!r} already exists: a run named "
                    f"{self.plan.groups[0].name.rsplit('-train-', 1)[0]!r} is running on this "
                    "cluster; stop it or set another run.name"
                )
            target = self._node_ids.get(g.node) or None
            self.groups[g.name] = placement_group(
                g.bundles, strategy=g.strategy, name=g.name,
                _soft_target_node_id=target if g.strategy == "STRICT_PACK" else None,
            )
        pending = {g.ready(): name for name, g in self.groups.items()}
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
        if len(ready) < len(pending):
            missing = sorted(pending[r] for r in pending if r not in ready)
            self.remove_groups()
            raise PlacementError(
                f"placement groups not placed after {timeout_s:.0f}s: {', '.join(missing)} "
                "(check `ray status` for the nodes' free resources)"
            )
        return self.groups

    def remove_groups(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in self.groups.values():
            remove_placement_group(g)
        self.groups.clear()

    def trainer_options(self, rank: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        item = next(i for i in self.plan.items if i.name == f"trainer/{rank}")
        if item.group not in self.groups:
            raise RuntimeError("call create_groups() before trainer_options()")
        return {
            "num_cpus": item.cpus,
            "num_gpus": item.gpus,
            "resources": self._role("train"),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.groups[item.group],
                placement_group_bundle_index=item.bundle,
                placement_group_capture_child_tasks=True,
            ),
        }

    def engine_deployment_options(self) -> dict[str, Any]:
        """Keyword arguments for `serve.deployment(...)` of the engine."""
        engines = self.plan.of("engine")
        first = engines[0]
        opts: dict[str, Any] = {
            "num_replicas": len(engines),
            "ray_actor_options": {
                "num_cpus": first.cpus,
                "num_gpus": first.gpus,
                "resources": self._role("rollout"),
            },
        }
        if self.plan.engine_replicas_per_node:
            opts["max_replicas_per_node"] = self.plan.engine_replicas_per_node
        return opts

    def service_options(self, num_cpus: float = 0.0) -> dict[str, Any]:
        """Options for an actor (or `ray_actor_options` of a deployment) on the service role."""
        return {"num_cpus": num_cpus, "resources": self._role("service")}

    def env_options(self) -> dict[str, Any]:
        """Options for the env actors, on `cluster.env_role` nodes, spread (SPREAD)."""
        envs = self.plan.of("env")
        role = envs[0].role if envs else "rollout"
        return {"num_cpus": envs[0].cpus if envs else 0.0, "resources": self._role(role),
                "scheduling_strategy": "SPREAD"}
