"""Subcommands for launching on clusters (`plan`, `preflight`, `submit`, `slurm`), registered
into the CLI.

Each parser sets `func` (a handler taking the parsed args and returning an exit code) and
imports its heavy machinery only inside the handler, so `rl360 --help` stays fast."""

from __future__ import annotations

import argparse
from typing import Any


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="path to a TOML recipe (see recipes/)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a recipe field, e.g. --set engine.replicas=2 (repeatable)",
    )


def _plan(args: argparse.Namespace) -> int:
    from rl360.launch.plan import plan_main

    return plan_main(args)


def _preflight(args: argparse.Namespace) -> int:
    from rl360.launch.preflight import preflight_main

    return preflight_main(args)


def _submit(args: argparse.Namespace) -> int:
    from rl360.launch.submit import submit_main

    return submit_main(args)


def _slurm(args: argparse.Namespace) -> int:
    from rl360.launch.slurm import slurm_main

    return slurm_main(args)


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "plan", help="print the resolved recipe and where every role lands (starts nothing)",
        description="Print the recipe's key settings and a table of where every actor and "
        "deployment replica lands, with resources per node. Nodes come from --nodes, else a "
        "live cluster (--address / ray.address / RAY_ADDRESS), else the recipe's cluster "
        "section, else this machine.",
    )
    _recipe_args(p)
    p.add_argument("--nodes", default="", metavar="SPEC",
                   help="plan on these nodes: ROLE=COUNTxGPUS[:CPUS],... e.g. "
                        "service=1x8,train=8x8:96,rollout=24x8:96 (ROLE 'any' = untagged)")
    p.add_argument("--address", default="", help="plan on the live Ray cluster at this address")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)

    p = sub.add_parser(
        "preflight", help="check Ray, GPUs, sandbox, model, disk and ports before a run",
        description="Check what a run needs, one line a check; exit 1 when any check fails.",
    )
    _recipe_args(p)
    p.add_argument("--address", default="",
                   help="check against the live Ray cluster at this address "
                        "(default: ray.address / RAY_ADDRESS when set)")
    p.add_argument("--min-free-gb", type=float, default=None,
                   help="free disk needed under run.out_dir (default: run.min_free_disk_gb)")
    p.set_defaults(func=_preflight)

    p = sub.add_parser(
        "submit", help="submit `rl360 train` (or eval/serve) as a Ray job to a running cluster",
        description="Wraps `ray job submit`: uploads the working directory (without .venv, "
        "runs, .git), runs `python -m rl360 <cmd> <recipe>` on the cluster, prints the job id "
        "and the dashboard link.",
    )
    _recipe_args(p)
    p.add_argument("--address", default="http://127.0.0.1:8265",
                   help="the Ray dashboard address (default: %(default)s)")
    p.add_argument("--entrypoint-cmd", default="train",
                   choices=["train", "eval", "serve", "plan", "preflight"],
                   help="the rl360 subcommand the job runs (default: train)")
    p.add_argument("--args", dest="extra_args", default="",
                   help="extra arguments for that subcommand, e.g. --args '--duration 60'")
    p.add_argument("--working-dir", default="",
                   help="directory uploaded as the job's working dir (default: the repo root)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment variable for the job (repeatable)")
    p.add_argument("--submission-id", default="", help="job id (default: rl360-<run>-<time>)")
    p.add_argument("--follow", action="store_true", help="stream the job's logs until it ends")
    p.set_defaults(func=_submit)

    p = sub.add_parser(
        "slurm", help="write (or print, --dry-run) the sbatch script that starts Ray and trains",
        description="Render the sbatch template for a recipe: a Ray head on the first node, "
        "workers with their role resources on the others (service, then train, then rollout "
        "nodes, as counted in the recipe's cluster section), wait until all joined, then "
        "`rl360 train`. --dry-run --nodes LIST prints the exact commands for a node list.",
    )
    _recipe_args(p)
    p.add_argument("--nodes", default="", metavar="HOSTLIST",
                   help="Slurm hostlist, e.g. node[01-33] or node[01-03,07],gpu[1-2]")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands run for --nodes instead of writing the script")
    p.add_argument("--out", default="", help="where to write the sbatch script "
                   "(default: <run.out_dir>/<run.name>/slurm.sbatch)")
    p.add_argument("--partition", default="", help="#SBATCH --partition")
    p.add_argument("--account", default="", help="#SBATCH --account")
    p.add_argument("--time", default="24:00:00", help="#SBATCH --time (default: %(default)s)")
    p.add_argument("--setup", default="",
                   help="shell line run first on every node, e.g. 'source ~/venv/bin/activate' "
                        "(default: activate the current virtualenv, if any)")
    p.add_argument("--ray-port", type=int, default=6379, help="GCS port on the head")
    p.add_argument("--dashboard-port", type=int, default=8265, help="dashboard port on the head")
    p.add_argument("--join-timeout", type=float, default=600.0,
                   help="seconds to wait for every node to join (default: %(default)s)")
    p.add_argument("--auth", choices=["token", "disabled"], default="token",
                   help="Ray token auth on the cluster (token: ~/.ray/auth_token, shared home)")
    p.add_argument("--submit", action="store_true", help="run sbatch on the written script")
    p.set_defaults(func=_slurm)
