"""Slurm: an sbatch script that starts a Ray cluster over the allocation and runs `rl360 train`.

Nodes take roles in the order of the recipe's `cluster` section: the first `service.nodes`
hosts (the first is the Ray head), then `train.nodes`, then `rollout.nodes`. Each Ray node is
started with its role resource (placement.node_resources) so the planner's actors land there.

    rl360 slurm recipe.toml --nodes node[01-33] --dry-run   # the exact commands, for these hosts
    rl360 slurm recipe.toml [--submit]                       # write (and sbatch) the script
    rl360 slurm recipe.toml --container-image rl360:gpu      # every node's commands in the image

With `--container-image` (docker/Dockerfile's image) every command runs inside it: through
Pyxis (`srun --container-image`, the default) or Apptainer (`apptainer exec --nv`), with the
working directory (and `--container-mounts`) bound at the same path.
    python -m rl360.launch.slurm wait --address node01:6379 --nodes 33 --timeout 600
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from rl360.launch.placement import ROLES, is_cluster_recipe, node_resources
from rl360.recipe import Recipe

TEMPLATE = Path(__file__).parent / "templates" / "slurm.sbatch"


class SlurmError(ValueError):
    """A node list or recipe the Slurm launcher cannot use; one line with the fix."""


class SlurmOptions(msgspec.Struct, kw_only=True):
    ray_port: int = 6379
    dashboard_port: int = 8265
    join_timeout_s: float = 600.0
    auth: str = "token"  # "token" | "disabled"
    setup: str = ""  # a shell line run first (e.g. activate a venv)
    workdir: str = ""  # where the job runs (default: the current directory)
    container_image: str = ""  # run every node's commands in this image ("" = on the host)
    container_runtime: str = "pyxis"  # "pyxis" (srun --container-image) | "apptainer"
    container_mounts: str = ""  # extra SRC[:DST] binds, comma-separated (models, shared storage)


CONTAINER_RUNTIMES = ("pyxis", "apptainer")


def _binds(opts: SlurmOptions) -> str:
    work = opts.workdir or os.getcwd()
    extra = [m.strip() for m in opts.container_mounts.split(",") if m.strip()]
    return ",".join([f"{work}:{work}", *(m if ":" in m else f"{m}:{m}" for m in extra)])


def container_flags(opts: SlurmOptions) -> str:
    """srun flags (Pyxis) for a step inside the image; "" without an image or with Apptainer."""
    if not opts.container_image or opts.container_runtime != "pyxis":
        return ""
    work = opts.workdir or os.getcwd()
    return (f" --container-image={shlex.quote(opts.container_image)}"
            f" --container-mounts={shlex.quote(_binds(opts))}"
            f" --container-workdir={shlex.quote(work)}")


def container_exec(opts: SlurmOptions) -> str:
    """The prefix that runs a command inside the image with Apptainer ("" otherwise)."""
    if not opts.container_image or opts.container_runtime != "apptainer":
        return ""
    work = opts.workdir or os.getcwd()
    return (f"apptainer exec --nv --bind {shlex.quote(_binds(opts))} --pwd {shlex.quote(work)} "
            f"{shlex.quote(opts.container_image)} ")


def on_head(opts: SlurmOptions, head: str = "") -> str:
    """The prefix for a command of the batch step itself (waits, `rl360 train`)."""
    if opts.container_image and opts.container_runtime == "pyxis":
        where = f" -w {head}" if head else ""
        return f"srun --overlap --nodes=1 --ntasks=1{where}{container_flags(opts)} "
    return container_exec(opts)


# ---------------------------------------------------------------------------- hostlists


def _split_top(spec: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in spec:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"hostlist {spec!r}: ']' without '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise SlurmError(f"hostlist {spec!r}: unclosed '['")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_range(body: str, spec: str) -> list[str]:
    out = []
    for item in body.split(","):
        lo, dash, hi = item.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise SlurmError(f"hostlist {spec!r}: bad range {item!r} (expected 01-08 or 7)")
        if not dash:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise SlurmError(f"hostlist {spec!r}: range {item!r} runs backwards")
        out.extend(str(i).zfill(len(lo)) for i in range(a, b + 1))
    return out


def expand_hostlist(spec: str) -> list[str]:
    """Slurm hostlist syntax: `node[01-03,07],gpu5,rack[1-2]-n[1-2]` -> host names in order."""
    hosts: list[str] = []
    for part in _split_top(spec):
        names = [""]
        for m in re.finditer(r"\[([^\]]*)\]|[^\[]+", part):
            if m.group(0).startswith("["):
                names = [n + x for n in names for x in _expand_range(m.group(1), spec)]
            else:
                names = [n + m.group(0) for n in names]
        hosts.extend(names)
    if not hosts:
        raise SlurmError(f"hostlist {spec!r}: no hosts")
    dup = sorted({h for h in hosts if hosts.count(h) > 1})
    if dup:
        raise SlurmError(f"hostlist {spec!r}: hosts listed twice: {', '.join(dup)}")
    return hosts


# ---------------------------------------------------------------------------- commands


def assign_roles(recipe: Recipe, hosts: list[str]) -> list[tuple[str, str]]:
    """(host, role) for each host: service first (the head), then train, then rollout."""
    if not is_cluster_recipe(recipe):
        raise SlurmError("the recipe has no cluster section: declare cluster.service/train/"
                         "rollout nodes (see recipes/gpu-dense-8b.toml)")
    counts = [(r, getattr(recipe.cluster, r).nodes) for r in ROLES]
    need = sum(n for _, n in counts)
    if len(hosts) != need:
        detail = " + ".join(f"{n} {r}" for r, n in counts)
        raise SlurmError(f"the recipe's cluster section needs {need} nodes ({detail}), the node "
                         f"list has {len(hosts)}: ask Slurm for --nodes={need} or change cluster.*.nodes")
    if recipe.cluster.service.nodes < 1:
        raise SlurmError("cluster.service.nodes must be at least 1: the first node is the Ray head")
    roles = [r for r, n in counts for _ in range(n)]
    return list(zip(hosts, roles, strict=True))


def _srun(host: str, cpus: int, gpus: int, opts: SlurmOptions | None = None) -> str:
    # --overlap: the batch step (this script, on the head) keeps its share of the node
    res = (f" --cpus-per-task={cpus}" if cpus else "") + (f" --gpus-per-task={gpus}" if gpus else "")
    if opts is None:
        return f"srun --overlap --nodes=1 --ntasks=1{res} -w {host}"
    return (f"srun --overlap --nodes=1 --ntasks=1{res} -w {host}{container_flags(opts)}"
            + (" " + container_exec(opts).rstrip() if container_exec(opts) else ""))


def _ray_start(role: str, cpus: int, gpus: int) -> str:
    res = json.dumps({k: int(v) if v == int(v) else v for k, v in node_resources([role]).items()},
                     separators=(", ", ": "))
    flags = (f" --num-cpus={cpus}" if cpus else "") + (f" --num-gpus={gpus}" if gpus else "")
    return f"{flags} --resources={shlex.quote(res)}"


def default_setup() -> str:
    """Activate the virtualenv rl360 runs from, when it runs from one."""
    if sys.prefix != sys.base_prefix:
        return f"source {shlex.quote(str(Path(sys.prefix) / 'bin' / 'activate'))}"
    return ""


def node_commands(recipe: Recipe, recipe_path: str, overrides: list[str], hosts: list[str],
                  opts: SlurmOptions) -> str:
    """The bash script run inside the allocation for these hosts (what --dry-run prints)."""
    placed = assign_roles(recipe, hosts)
    head = placed[0][0]
    address = f"{head}:{opts.ray_port}"
    if opts.container_image and opts.container_runtime not in CONTAINER_RUNTIMES:
        raise SlurmError(f"--container-runtime {opts.container_runtime!r}: use one of "
                         f"{', '.join(CONTAINER_RUNTIMES)}")
    run = on_head(opts, head)
    wait = (f"{run}python -m rl360.launch.slurm wait --address {address} "
            f"--timeout {opts.join_timeout_s:g}")
    lines = [
        "#!/bin/bash",
        f"# rl360 slurm: {len(hosts)} nodes for {recipe_path}",
    ]
    for role in ROLES:
        mine = [h for h, r in placed if r == role]
        lines.append(f"#   {role:<8} {len(mine):>3}  {' '.join(mine)}")
    lines += [
        "set -euo pipefail",
        "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # Ray steps end with this script",
    ]
    if opts.workdir:
        lines.append(f"cd {shlex.quote(opts.workdir)}")
    if opts.setup:
        lines.append(opts.setup)
    lines.append(f"export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE={opts.auth}")
    if opts.container_image:
        lines.append(f"# every command below runs in {opts.container_image} ({opts.container_runtime})")
    if opts.auth == "token":
        lines.append(f"{run}ray get-auth-token --generate > /dev/null  # ~/.ray/auth_token, "
                     "shared home")
    for i, (host, role) in enumerate(placed):
        spec = getattr(recipe.cluster, role)
        cpus, gpus = spec.cpus_per_node, spec.gpus_per_node
        if i == 0:
            lines.append(
                f"{_srun(host, cpus, gpus, opts)} ray start --head --block --port={opts.ray_port} "
                f"--dashboard-host=0.0.0.0 --dashboard-port={opts.dashboard_port}"
                f"{_ray_start(role, cpus, gpus)} &"
            )
            lines.append(f"{wait} --nodes 1")
        else:
            lines.append(f"{_srun(host, cpus, gpus, opts)} ray start --block --address={address}"
                         f"{_ray_start(role, cpus, gpus)} &")
    lines.append(f"{wait} --nodes {len(placed)}")
    lines.append(f"echo \"rl360: Ray dashboard http://{head}:{opts.dashboard_port}\"")
    lines.append(f"RAY_ADDRESS={address} {run}python -m rl360 train {shlex.quote(recipe_path)}"
                 f"{''.join(' --set ' + shlex.quote(o) for o in overrides)}")
    return "\n".join(lines) + "\n"


def render_sbatch(recipe: Recipe, recipe_path: str, overrides: list[str], opts: SlurmOptions,
                  time_limit: str = "24:00:00", partition: str = "", account: str = "") -> str:
    c = recipe.cluster
    num_nodes = sum(getattr(c, r).nodes for r in ROLES)
    log_dir = str(Path(recipe.run.out_dir) / recipe.run.name)
    extra = [f"#SBATCH --partition={partition}"] if partition else []
    extra += [f"#SBATCH --account={account}"] if account else []
    gpus = max(getattr(c, r).gpus_per_node for r in ROLES)
    extra += [f"#SBATCH --gpus-per-node={gpus}"] if gpus else []
    options = (f" --ray-port {opts.ray_port} --dashboard-port {opts.dashboard_port}"
               f" --join-timeout {opts.join_timeout_s:g} --auth {opts.auth}")
    if opts.setup:
        options += f" --setup {shlex.quote(opts.setup)}"
    if opts.container_image:
        options += (f" --container-image {shlex.quote(opts.container_image)}"
                    f" --container-runtime {opts.container_runtime}")
        if opts.container_mounts:
            options += f" --container-mounts {shlex.quote(opts.container_mounts)}"
    values = {
        "recipe": shlex.quote(recipe_path),
        "job_name": f"rl360-{recipe.run.name}",
        "num_nodes": str(num_nodes),
        "time": time_limit,
        "log_dir": log_dir,
        "sbatch_extra": "\n".join(extra),
        "workdir": shlex.quote(opts.workdir or os.getcwd()),
        "setup": opts.setup,
        "overrides": "".join(" --set " + shlex.quote(o) for o in overrides),
        "options": options,
        "launch": on_head(opts),  # the batch step's own rl360 call, in the image when asked
    }
    text = TEMPLATE.read_text()
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    left = re.findall(r"\{\{(\w+)\}\}", text)
    if left:
        raise SlurmError(f"template {TEMPLATE}: no value for {', '.join(left)}")
    return text.rstrip("\n") + "\n"


# ---------------------------------------------------------------------------- waiting


def wait_for_nodes(address: str, count: int, timeout_s: float, poll_s: float = 2.0) -> int:
    """Polls the cluster until `count` nodes are alive; returns how many joined."""
    import ray

    deadline = time.monotonic() + timeout_s
    alive, last = 0, -1
    while time.monotonic() < deadline:
        try:
            if not ray.is_initialized():
                ray.init(address=address, log_to_driver=False, logging_level="ERROR")
            alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        except Exception:  # the head is not up yet
            ray.shutdown()
        if alive != last:
            print(f"rl360: {alive}/{count} Ray nodes joined", flush=True)
            last = alive
        if alive >= count:
            break
        time.sleep(poll_s)
    if ray.is_initialized():
        ray.shutdown()
    return alive


# ---------------------------------------------------------------------------- entry points


def _options(args: argparse.Namespace) -> SlurmOptions:
    image = getattr(args, "container_image", "")
    return SlurmOptions(ray_port=args.ray_port, dashboard_port=args.dashboard_port,
                        join_timeout_s=args.join_timeout, auth=args.auth,
                        # in an image, the host's virtualenv means nothing
                        setup=args.setup or ("" if image else default_setup()),
                        workdir=os.getcwd(), container_image=image,
                        container_runtime=getattr(args, "container_runtime", "pyxis"),
                        container_mounts=getattr(args, "container_mounts", ""))


def slurm_command(recipe: Recipe, args: argparse.Namespace) -> int:
    opts = _options(args)
    try:
        if args.dry_run:
            if not args.nodes:
                raise SlurmError("--dry-run needs --nodes HOSTLIST, e.g. --nodes 'node[01-33]'")
            hosts = expand_hostlist(args.nodes)
            sys.stdout.write(node_commands(recipe, args.recipe, args.overrides, hosts, opts))
            return 0
        # check the recipe (and the node list, if given) before writing anything
        total = sum(getattr(recipe.cluster, r).nodes for r in ROLES)
        assign_roles(recipe, expand_hostlist(args.nodes) if args.nodes
                     else [f"node{i}" for i in range(total)])
        text = render_sbatch(recipe, args.recipe, args.overrides, opts, args.time,
                             args.partition, args.account)
    except SlurmError as exc:
        print(f"rl360 slurm: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or Path(recipe.run.out_dir) / recipe.run.name / "slurm.sbatch")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"rl360: wrote {out}\n  see its commands: rl360 slurm {args.recipe} --nodes "
          f"'<hostlist>' --dry-run\n  submit:          sbatch {out}")
    if args.submit:
        return subprocess.run(["sbatch", str(out)], check=False).returncode
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl360.launch.slurm")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait", help="wait until N Ray nodes are alive")
    w.add_argument("--address", required=True)
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    alive = wait_for_nodes(args.address, args.nodes, args.timeout)
    if alive < args.nodes:
        print(f"rl360: only {alive} of {args.nodes} Ray nodes joined after {args.timeout:g}s: "
              "read the Ray worker lines of this job's log", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
