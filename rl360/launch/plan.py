"""`rl360 plan`: the resolved recipe's key settings and a table of where every actor and
deployment replica lands, with the resources used on each node. Starts nothing. Also where
node lists come from (declared, `--nodes`, `ray.nodes()`, this machine) for the planner.

The node list comes from, in order: `--nodes ROLE=COUNTxGPUS[:CPUS],...`; a live cluster
(`--address`, `ray.address` or RAY_ADDRESS: read with `ray.nodes()`, nothing is scheduled);
the recipe's own `cluster` section (simulated nodes); this machine (the CPU demo).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections import Counter
from typing import Any

import msgspec

from rl360.launch.adapters import check_lora_targets, memory_lines
from rl360.launch.estimate import estimate, render_estimate
from rl360.launch.placement import (
    ROLE_CAPACITY,
    ROLES,
    NodeInfo,
    PlacementError,
    Plan,
    is_cluster_recipe,
    plan_placement,
    plural,
    role_resource,
)
from rl360.launch.support import support_problems
from rl360.launch.throughput import EstimateError, figures_for
from rl360.recipe import ClusterRole, Recipe, RecipeError

# ---------------------------------------------------------------------------- node lists


def declared_nodes(recipe: Recipe) -> list[NodeInfo]:
    """A simulated node list built from the recipe's `cluster` section (names like train-03)."""
    nodes = []
    for role in ROLES:
        spec: ClusterRole = getattr(recipe.cluster, role)
        for i in range(spec.nodes):
            nodes.append(
                NodeInfo(
                    name=f"{role}-{i:02d}",
                    roles=[role],
                    cpus=float(spec.cpus_per_node) if spec.cpus_per_node else None,
                    gpus=float(spec.gpus_per_node),
                    head=not nodes,
                )
            )
    return nodes


def local_node(cpus: float, gpus: float = 0.0) -> list[NodeInfo]:
    return [NodeInfo(name="local", cpus=cpus, gpus=gpus, head=True)]


def parse_nodes_spec(spec: str) -> list[NodeInfo]:
    """`service=1x8,train=8x8:96,rollout=24x8` -> nodes: ROLE=COUNTxGPUS[:CPUS] per group.

    A role may be `any` (untagged nodes, for local-style plans)."""
    nodes: list[NodeInfo] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        role, sep, rest = part.partition("=")
        role = role.strip()
        count, x, res = rest.partition("x")
        gpus, _, cpus = res.partition(":")
        try:
            if not sep or not x or role not in (*ROLES, "any"):
                raise ValueError
            n, g, c = int(count), float(gpus), float(cpus) if cpus else None
        except ValueError:
            raise PlacementError(
                f"--nodes {part!r}: expected ROLE=COUNTxGPUS[:CPUS] with ROLE one of "
                f"{', '.join((*ROLES, 'any'))}, e.g. train=8x8:96"
            ) from None
        start = sum(1 for nd in nodes if nd.name.startswith(f"{role}-"))
        for i in range(n):
            nodes.append(
                NodeInfo(name=f"{role}-{start + i:02d}", roles=[] if role == "any" else [role],
                         cpus=c, gpus=g)
            )
    if not nodes:
        raise PlacementError(f"--nodes {spec!r}: no nodes (e.g. service=1x8,train=8x8,rollout=24x8)")
    head = next((n for n in nodes if "service" in n.roles), nodes[0])
    head.head = True
    return nodes


def nodes_from_ray(ray_nodes: list[dict[str, Any]]) -> list[NodeInfo]:
    """NodeInfo for each live node of `ray.nodes()`, its roles read from its custom resources."""
    out = []
    for nd in ray_nodes:
        if not nd.get("Alive", True):
            continue
        res = nd.get("Resources", {})
        roles = [r for r in ROLES if res.get(role_resource(r), 0) > 0]
        ip = nd.get("NodeManagerAddress", "")
        node_id = nd.get("NodeID", "")
        out.append(
            NodeInfo(
                name=nd.get("NodeManagerHostname") or ip or node_id[:8],
                roles=roles,
                cpus=float(res.get("CPU", 0.0)),
                gpus=float(res.get("GPU", 0.0)),
                node_id=node_id,
                ip=ip,
                head="node:__internal_head__" in res,
            )
        )
    names = Counter(n.name for n in out)
    for n in out:  # fake clusters (and some real ones) share a hostname: make names unique
        if names[n.name] > 1:
            n.name = f"{n.name}:{n.node_id[:6]}"
    return out


def plan_live(recipe: Recipe) -> Plan:
    """The plan for the cluster this process is connected to (inside a Ray session)."""
    import ray

    return plan_placement(recipe, nodes_from_ray(ray.nodes()), "the connected cluster")


def local_gpu_count() -> int:
    """GPUs on this machine, from `nvidia-smi -L` (no torch import); 0 without a driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def live_nodes(address: str) -> list[NodeInfo]:
    """The alive nodes of a running cluster; connects as a driver and leaves at once."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except Exception as exc:
        raise PlacementError(
            f"cannot reach Ray at {address!r} ({type(exc).__name__}: {exc}); unset "
            "RAY_ADDRESS / --address to plan against the recipe's cluster section"
        ) from None
    try:
        return nodes_from_ray(ray.nodes())
    finally:
        ray.shutdown()


def resolve_nodes(recipe: Recipe, nodes_spec: str = "", address: str = "") -> tuple[list[NodeInfo], str]:
    if nodes_spec:
        return parse_nodes_spec(nodes_spec), f"--nodes {nodes_spec}"
    address = address or recipe.ray.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        return live_nodes(address), f"the live cluster at {address}"
    if is_cluster_recipe(recipe):
        n = sum(getattr(recipe.cluster, r).nodes for r in ROLES)
        return declared_nodes(recipe), f"the recipe's cluster section (simulated, {n} nodes)"
    cpus = float(recipe.ray.num_cpus or os.cpu_count() or 1)
    return local_node(cpus, float(local_gpu_count())), "this machine (a local Ray)"


# ---------------------------------------------------------------------------- text


def _ranges(nums: list[int]) -> str:
    """[0, 1, 2, 3, 7, 9, 10] -> "0-3,7,9-10"."""
    nums = sorted(nums)
    out: list[str] = []
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(out)


def _g(x: float) -> str:
    return f"{x:g}"


def describe_recipe(recipe: Recipe, path: str) -> list[str]:
    r, m, e, t, s = recipe.run, recipe.model, recipe.engine, recipe.trainer, recipe.serve
    lines = [f"recipe    {path}  (run {r.name!r}, out_dir {r.out_dir}, seed {r.seed})"]
    lines.append(f"model     {m.path}  {m.dtype}  max_model_len {m.max_model_len}  "
                 f"chat_template {m.chat_template}")
    par = f", tensor parallel {e.tensor_parallel}" if e.tensor_parallel > 1 else ""
    par += f", expert parallel {e.expert_parallel}" if e.expert_parallel > 1 else ""
    lines.append(f"engine    {e.backend}: {plural(e.replicas, 'replica')} x "
                 f"({plural(e.num_gpus, 'GPU')}, {plural(e.num_cpus, 'CPU')}){par}, "
                 f"batch {e.max_batch_size}")
    if t.backend == "megatron":
        mp = t.megatron.tensor_parallel * t.megatron.pipeline_parallel * t.megatron.context_parallel
        dp = t.workers // mp if t.workers % mp == 0 else "?"
        layout = (f", TP {t.megatron.tensor_parallel} x PP {t.megatron.pipeline_parallel} x CP "
                  f"{t.megatron.context_parallel} x DP {dp}, EP {t.megatron.expert_parallel}")
    elif t.backend == "fsdp":
        layout = f", FSDP2-sharded data parallel {t.workers}"
    else:
        layout = f", data parallel {t.workers}"
    lines.append(f"trainer   {t.backend}: {plural(t.workers, 'rank')} x "
                 f"({plural(t.num_gpus, 'GPU')}, {plural(t.num_cpus, 'CPU')}){layout}, "
                 f"{t.dtype}, lr {t.lr:g}")
    lines.append(f"loss      {t.loss.name}, advantage {t.advantage}, reducer {t.loss.reducer}, "
                 f"micro batch {t.micro_batch_size}")
    env = recipe.env
    where = f", on {recipe.cluster.env_role} nodes" if is_cluster_recipe(recipe) else ""
    lines.append(f"env       {plural(env.actors, 'env actor')} x {env.episodes_per_actor} episodes "
                 f"({plural(env.num_cpus, 'CPU')} each), sandbox {env.sandbox}{where}")
    lines.append(f"serve     http://{s.host}:{s.port}  app {s.app_name!r}, "
                 f"{plural(s.server_replicas, 'session server')}, "
                 f"{plural(s.session_shards, 'session shard')}")
    if is_cluster_recipe(recipe):
        parts = []
        for role in ROLES:
            c = getattr(recipe.cluster, role)
            parts.append(f"{role} {c.nodes} x ({c.gpus_per_node} GPUs, {c.cpus_per_node or '?'} CPUs)")
        lines.append("cluster   " + ", ".join(parts))
    else:
        lines.append(f"cluster   local (no cluster section); ray.num_cpus {recipe.ray.num_cpus or 'all'}")
    return lines


def _what(items: list[Any], head: bool) -> str:
    groups: dict[str, list[int]] = {}
    for it in items:
        kind, _, idx = it.name.partition("/")
        groups.setdefault(kind, []).append(int(idx))
    parts = ["Ray head"] if head else []
    for kind, idxs in groups.items():
        label = {"trainer": "trainer ranks", "engine": "engine replicas",
                 "env": "env actors"}.get(kind, kind)
        parts.append(f"{label} {_ranges(idxs)}" if len(idxs) > 1 or label != kind else kind)
    return "; ".join(parts) or "(idle)"


def plan_table(plan: Plan) -> list[str]:
    name_w = max(4, *(len(n.name) for n in plan.nodes))
    role_w = max(4, *(len(",".join(n.roles) or "any") for n in plan.nodes))
    lines = [f"{'NODE':<{name_w}}  {'ROLE':<{role_w}}  {'CPUs':>9}  {'GPUs':>7}  WHAT"]
    for n in plan.nodes:
        items = plan.on(n.name)
        cpus = sum(i.cpus for i in items)
        gpus = sum(i.gpus for i in items)
        roles = ",".join(n.roles) or ("any" if plan.mode == "local" else "-")
        cap_c = "?" if n.cpus is None else _g(n.cpus)
        lines.append(f"{n.name:<{name_w}}  {roles:<{role_w}}  {_g(cpus) + '/' + cap_c:>9}  "
                     f"{_g(gpus) + '/' + _g(n.gpus):>7}  {_what(items, n.head)}")
    return lines


def plan_summary(plan: Plan, recipe: Recipe) -> list[str]:
    lines = []
    for g in plan.groups[:1]:
        shapes = Counter(len(x.bundles) for x in plan.groups)
        lines.append(
            f"trainer:  {plural(len(plan.groups), 'placement group')}, STRICT_PACK per node "
            f"({', '.join(f'{k} x {v} bundles' for v, k in sorted(shapes.items()))}); bundle "
            f"{g.bundles[0]}"
        )
    engines = plan.of("engine")
    if engines:
        opts = [f"num_gpus={_g(engines[0].gpus)}", f"num_cpus={_g(engines[0].cpus)}"]
        if plan.mode == "cluster":
            opts.append(f'resources={{"{role_resource("rollout")}": 0.001}}')
        if plan.engine_replicas_per_node:
            opts.append(f"max_replicas_per_node={plan.engine_replicas_per_node}")
        lines.append(f"engine:   Serve deployment 'engine', {plural(len(engines), 'replica')} "
                     f"spread over {plural(len({e.node for e in engines}), 'node')}; "
                     f"{', '.join(opts)}")
    envs = plan.of("env")
    if envs:
        res = f', resources={{"{role_resource(envs[0].role)}": 0.001}}' if plan.mode == "cluster" else ""
        lines.append(f"env:      {plural(len(envs), 'env actor')}, SPREAD over "
                     f"{plural(len({e.node for e in envs}), 'node')}; num_cpus={_g(envs[0].cpus)}{res}")
    service = [i for i in plan.items if i.role == "service"]
    if service and plan.mode == "cluster":
        lines.append(f"service:  {plural(len(service), 'actor')} and replicas with "
                     f'resources={{"{role_resource("service")}": 0.001}}')
    if plan.mode == "cluster":
        lines.append(f"roles:    each node is started with its role resource, e.g. "
                     f"--resources '{{\"{role_resource('train')}\": {ROLE_CAPACITY:g}}}'")
    for role in ROLES:
        nodes = [n for n in plan.nodes if role in n.roles] if plan.mode == "cluster" else []
        if nodes:
            used = sum(i.gpus for i in plan.items if i.role == role)
            have = sum(n.gpus for n in nodes)
            lines.append(f"gpus:     {role:<8} {_g(used)}/{_g(have)} used")
    lines.extend(f"warning:  {w}" for w in plan.warnings)
    return lines


def render(plan: Plan, recipe: Recipe, path: str) -> str:
    out = describe_recipe(recipe, path)
    out.extend(memory_lines(recipe))
    out.append(f"planned on {plan.source}")
    out.append("")
    out.extend(plan_table(plan))
    out.append("")
    out.extend(plan_summary(plan, recipe))
    return "\n".join(out)


def plan_command(recipe: Recipe, args: argparse.Namespace) -> int:
    problems = support_problems(recipe)
    try:
        check_lora_targets(recipe)
    except RecipeError as exc:
        problems.append(str(exc))
    for p in problems:
        print(f"rl360 plan: {p}", file=sys.stderr)
    if problems:
        return 2
    try:
        nodes, source = resolve_nodes(recipe, args.nodes, args.address)
        plan = plan_placement(recipe, nodes, source)
    except PlacementError as exc:
        print(f"rl360 plan: {exc}", file=sys.stderr)
        return 2
    est = None
    if getattr(args, "estimate", False) or getattr(args, "metrics", ""):
        try:
            est = estimate(recipe, figures_for(recipe, args.metrics, args.throughput))
        except EstimateError as exc:
            print(f"rl360 plan: {exc}", file=sys.stderr)
            return 2
    if args.json:
        text = msgspec.json.encode({"plan": plan, "estimate": est} if est else plan).decode()
    else:
        text = render(plan, recipe, args.recipe)
        if est is not None:
            text += "\n\n" + "\n".join(render_estimate(est, recipe))
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `rl360 plan ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
