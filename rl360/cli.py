"""The `rl360` command line. Nothing heavy is imported until a subcommand runs, so
`rl360 --help` returns at once."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from rl360 import __version__


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="path to a TOML recipe (see recipes/)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a recipe field, e.g. --set engine.replicas=2 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rl360",
        description="RL post-training for coding and tool-using agents, on Ray.",
    )
    parser.add_argument("--version", action="version", version=f"rl360 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("serve", help="run the engines and the OpenAI-compatible session server")
    _recipe_args(p)
    p.add_argument("--duration", type=float, default=0.0,
                   help="stop after this many seconds (default: run until Ctrl-C)")

    p = sub.add_parser("eval", help="run every task x attempts on the current policy")
    _recipe_args(p)
    p.add_argument("--calibrate", action="store_true",
                   help="write per-task pass rates and a task list inside a pass-rate band")
    p.add_argument("--model", default=None, help="evaluate this model instead of model.path")

    p = sub.add_parser("train", help="fully asynchronous RL training (engines, envs, trainer)")
    _recipe_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")

    p = sub.add_parser("sft", help="supervised fine-tuning on chats (warm-start a policy)")
    _recipe_args(p)

    p = sub.add_parser("recipe", help="check or print recipes")
    rsub = p.add_subparsers(dest="recipe_command", metavar="ACTION", required=True)
    q = rsub.add_parser("show", help="print the resolved recipe with every default")
    _recipe_args(q)
    q = rsub.add_parser("check", help="validate recipes (exit 2 on the first bad one)")
    q.add_argument("recipes", nargs="+")

    # subcommands owned by other modules register themselves (each sets `func`)
    from rl360.launch import cli_ext
    from rl360.merge import cli as merge_cli

    merge_cli.add_parser(sub)
    cli_ext.add_parsers(sub)
    return parser


def _cmd_recipe(args: argparse.Namespace) -> int:
    import msgspec

    from rl360.recipe import load_recipe

    if args.recipe_command == "show":
        r = load_recipe(args.recipe, args.overrides)
        print(json.dumps(msgspec.to_builtins(r), indent=2))
        return 0
    for path in args.recipes:
        load_recipe(path)
        print(f"ok  {path}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from rl360.launch.commands import serve_main

    return serve_main(args)


def _cmd_eval(args: argparse.Namespace) -> int:
    from rl360.launch.commands import eval_main

    return eval_main(args)


def _cmd_train(args: argparse.Namespace) -> int:
    from rl360.launch.train_run import run_train
    from rl360.recipe import load_recipe

    return run_train(load_recipe(args.recipe, args.overrides), resume=args.resume)


def _cmd_sft(args: argparse.Namespace) -> int:
    from rl360.launch.paths import resolve_run_paths
    from rl360.policies.sft import run_sft
    from rl360.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    if note := resolve_run_paths(recipe):
        print(note, file=sys.stderr)
    stats = run_sft(recipe.sft, seed=recipe.run.seed)
    print(f"sft: {stats['samples']} chats, final loss {stats['loss']:.4f}, "
          f"{stats['seconds']:.1f}s -> {recipe.sft.out}")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": _cmd_train,
    "sft": _cmd_sft,
    "serve": _cmd_serve,
    "eval": _cmd_eval,
    "recipe": _cmd_recipe,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    handler = COMMANDS.get(args.command) or getattr(args, "func", None)
    if handler is None:
        parser.error(f"unknown command {args.command}")
    from rl360.launch.placement import PlacementError
    from rl360.recipe import RecipeError

    try:
        return int(handler(args) or 0)
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
