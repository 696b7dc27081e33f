"""The `rl360` command line: one table of commands, each with its arguments and its handler.

A command that takes a recipe gets it loaded once here (TOML + `--set`, checked, relative run
paths rebased inside a Ray job) and its handler is called as `handler(recipe, args)`; the
others get `handler(args)`. Handlers are named as "module:function" and imported only when
their command runs, so `rl360 --help` answers at once without importing torch or Ray.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from rl360 import __version__
from rl360.launch.paths import resolve_run_paths
from rl360.launch.placement import PlacementError
from rl360.launch.plot_runs import add_arguments as plot_arguments
from rl360.merge.cli import DESCRIPTION as MERGE_DESCRIPTION
from rl360.merge.cli import add_arguments as merge_arguments
from rl360.recipe import RecipeError, load_recipe
from rl360.serve.search.cli import DESCRIPTION as INDEX_DESCRIPTION
from rl360.serve.search.cli import add_arguments as index_arguments


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="path to a TOML recipe (see recipes/)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a recipe field, e.g. --set engine.replicas=2 (repeatable)",
    )


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=0.0,
                   help="stop after this many seconds (default: run until Ctrl-C)")


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibrate", action="store_true",
                   help="write per-task pass rates and a task list inside a pass-rate band")
    p.add_argument("--model", default=None, help="evaluate this model instead of model.path")
    p.add_argument("--against", default=None, metavar="EVAL_JSONL",
                   help="compare pass@1 with an earlier eval of the same tasks (its eval.jsonl): "
                        "per family, each side's 95%% CI and the paired bootstrap difference")


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")


def _recipe_cmd_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="recipe_command", metavar="ACTION", required=True)
    q = sub.add_parser("show", help="print the resolved recipe with every default")
    _recipe_args(q)
    q = sub.add_parser("check", help="validate recipes (exit 2 on the first bad one)")
    q.add_argument("recipes", nargs="+")


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", default="", metavar="SPEC",
                   help="plan on these nodes: ROLE=COUNTxGPUS[:CPUS],... e.g. "
                        "service=1x8,train=8x8:96,rollout=24x8:96 (ROLE 'any' = untagged)")
    p.add_argument("--address", default="", help="plan on the live Ray cluster at this address")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--estimate", action="store_true",
                   help="also predict generation, training, weight-sync and step time, the "
                        "bottleneck and the GPU split that balances it")
    p.add_argument("--metrics", default="", metavar="METRICS_JSONL",
                   help="refine the estimate's figures from a run's metrics.jsonl (implies "
                        "--estimate)")
    p.add_argument("--throughput", action="append", default=[], metavar="KEY=VALUE",
                   help="override one estimate figure, e.g. engine_tokens_per_s=5000 "
                        "(repeatable; keys in rl360/launch/throughput.py)")


def _preflight_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="",
                   help="check against the live Ray cluster at this address "
                        "(default: ray.address / RAY_ADDRESS when set)")
    p.add_argument("--min-free-gb", type=float, default=None,
                   help="free disk needed under run.out_dir (default: run.min_free_disk_gb)")


def _submit_args(p: argparse.ArgumentParser) -> None:
    _recipe_args(p)  # the job loads the recipe on the cluster; submit checks it first
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


def _slurm_args(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--container-image", default="", metavar="IMAGE",
                   help="run every node's commands in this image (docker/Dockerfile), e.g. "
                        "rl360:gpu or a .sqsh/.sif file")
    p.add_argument("--container-runtime", choices=["pyxis", "apptainer"], default="pyxis",
                   help="how: Pyxis (srun --container-image) or Apptainer (apptainer exec "
                        "--nv); default: %(default)s")
    p.add_argument("--container-mounts", default="", metavar="SRC[:DST],...",
                   help="extra binds besides the working directory, e.g. /models,/shared")


@dataclass(frozen=True)
class Command:
    help: str
    handler: str  # "module:function"
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    takes_recipe: bool = True  # load the recipe positional once and call handler(recipe, args)
    description: str | None = None


COMMANDS: dict[str, Command] = {
    "serve": Command("run the engines and the OpenAI-compatible session server",
                     "rl360.launch.serve_run:serve_command", _serve_args),
    "eval": Command("run every task x attempts on the current policy",
                    "rl360.launch.eval_run:eval_command", _eval_args),
    "train": Command("fully asynchronous RL training (engines, envs, trainer)",
                     "rl360.launch.train_run:train_command", _train_args),
    "sft": Command("supervised fine-tuning on chats (warm-start a policy)",
                   "rl360.launch.warm_start:sft_command"),
    "recipe": Command("check or print recipes", "rl360.cli:recipe_command", _recipe_cmd_args,
                      takes_recipe=False),
    "merge": Command("merge expert checkpoints", "rl360.merge.cli:run_args", merge_arguments,
                     takes_recipe=False, description=MERGE_DESCRIPTION),
    "index": Command("build and query search indexes (BM25, optional dense)",
                     "rl360.serve.search.cli:run_args", index_arguments, takes_recipe=False,
                     description=INDEX_DESCRIPTION),
    "plot": Command("plot several runs' reward against wall-clock time or step",
                    "rl360.launch.plot_runs:plot_command", plot_arguments, takes_recipe=False),
    "plan": Command(
        "print the resolved recipe and where every role lands (starts nothing)",
        "rl360.launch.plan:plan_command", _plan_args,
        description="Print the recipe's key settings and a table of where every actor and "
        "deployment replica lands, with resources per node. Nodes come from --nodes, else a "
        "live cluster (--address / ray.address / RAY_ADDRESS), else the recipe's cluster "
        "section, else this machine."),
    "preflight": Command(
        "check Ray, GPUs, sandbox, model, disk and ports before a run",
        "rl360.launch.preflight:preflight_command", _preflight_args,
        description="Check what a run needs, one line a check; exit 1 when any check fails."),
    "submit": Command(
        "submit `rl360 train` (or eval/serve) as a Ray job to a running cluster",
        "rl360.launch.submit:submit_command", _submit_args, takes_recipe=False,
        description="Wraps `ray job submit`: uploads the working directory (without .venv, "
        "runs, .git), runs `python -m rl360 <cmd> <recipe>` on the cluster, prints the job id "
        "and the dashboard link."),
    "slurm": Command(
        "write (or print, --dry-run) the sbatch script that starts Ray and trains",
        "rl360.launch.slurm:slurm_command", _slurm_args,
        description="Render the sbatch template for a recipe: a Ray head on the first node, "
        "workers with their role resources on the others (service, then train, then rollout "
        "nodes, as counted in the recipe's cluster section), wait until all joined, then "
        "`rl360 train`. --dry-run --nodes LIST prints the exact commands for a node list."),
}


def recipe_command(args: argparse.Namespace) -> int:
    if args.recipe_command == "show":
        r = load_recipe(args.recipe, args.overrides)
        print(json.dumps(msgspec.to_builtins(r), indent=2))
        return 0
    from rl360.launch.adapters import check_lora_targets
    from rl360.launch.stack import check_recipe_parts

    for path in args.recipes:
        recipe = load_recipe(path)
        check_recipe_parts(recipe)  # env.params and [search] too
        check_lora_targets(recipe)  # trainer.lora.targets against the model, when it is here
        print(f"ok  {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rl360",
        description="RL post-training for coding and tool-using agents, on Ray.",
    )
    parser.add_argument("--version", action="version", version=f"rl360 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.description or cmd.help)
        if cmd.takes_recipe:
            _recipe_args(p)
        if cmd.arguments is not None:
            cmd.arguments(p)
    return parser


def _handler(spec: str) -> Callable[..., int]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    cmd = COMMANDS[args.command]
    try:
        if not cmd.takes_recipe:
            return int(_handler(cmd.handler)(args) or 0)
        recipe = load_recipe(args.recipe, args.overrides)
        if note := resolve_run_paths(recipe):
            print(note, file=sys.stderr)
        return int(_handler(cmd.handler)(recipe, args) or 0)
    except RecipeError as exc:
        print(f"rl360: recipe error: {exc}", file=sys.stderr)
        return 2
    except PlacementError as exc:  # the cluster cannot hold the recipe's roles
        print(f"rl360: placement: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rl360: interrupted; shut down cleanly", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
