"""`rl360 merge merge.toml`: merge expert checkpoints as a recipe says; an expert may be a LoRA
adapter directory (rl360.merge.adapters). `rl360 merge --adapter DIR --out OUT` merges one
adapter into its base (task arithmetic at lambda 1: W + s * B @ A).

The project CLI (rl360/cli.py) lists it with `add_arguments` and `run_args` (parsed namespace
-> exit status); `main(argv)` runs it standalone. Bad input prints one
line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from rl360.merge import recipe as R
from rl360.merge.errors import MergeError
from rl360.merge.evaluators import recipe_evaluator
from rl360.merge.greedy import greedy_soup
from rl360.merge.report import Summary
from rl360.merge.runner import merge_checkpoints
from rl360.recipe import apply_overrides

DESCRIPTION = (
    "Merge RL expert checkpoints of one base model (soup, greedy soup, task arithmetic, TIES, "
    "DARE, RAM/RAM+, ULP-gate, Gram-soup, Model Stock, Iso-C/Iso-CTS), streaming tensor by tensor; "
    "experts may be LoRA adapters. --adapter DIR --out OUT merges one adapter into its base."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", type=Path, nargs="?",
                   help="merge recipe (TOML), e.g. examples/merge/merge.toml")
    p.add_argument("--adapter", type=Path, default=None,
                   help="merge this LoRA adapter directory into its base (no recipe; needs --out)")
    p.add_argument("--base", type=Path, default=None,
                   help="with --adapter: the base model (default: the one the adapter names)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set method.density=0.3 (repeatable)")  # fmt: skip
    p.add_argument(
        "--ray", action="store_true", default=None, help="merge shards as parallel Ray tasks"
    )
    p.add_argument("--out", help="output directory (overrides output.dir)")
    p.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="output dtype"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def run_recipe(
    recipe: R.Recipe,
    ray: bool | None = None,
    progress: bool | None = None,
    evaluator: Callable[[Path], float] | None = None,
) -> Summary:
    """Run a validated recipe (greedy soup goes through `greedy.greedy_soup`)."""
    if isinstance(recipe.method, R.GreedySoup):
        score = evaluator or recipe_evaluator(recipe.method.evaluator, recipe.method.metric)
        return greedy_soup(
            recipe.base, recipe.experts, score, recipe.output, recipe.run, ray, progress
        )
    return merge_checkpoints(
        recipe.base, recipe.experts, recipe.method, recipe.output, recipe.run, ray, progress
    )


def run_args(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.out:
        overrides.append(f"output.dir={json.dumps(args.out)}")
    if args.dtype:
        overrides.append(f"output.dtype={json.dumps(args.dtype)}")
    if args.overwrite:
        overrides.append("output.overwrite=true")
    try:
        recipe = _adapter_recipe(args, overrides) if args.adapter else _recipe(args, overrides)
        summary = run_recipe(recipe, ray=args.ray, progress=False if args.no_progress else None)
    except MergeError as e:
        print(f"rl360 merge: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"rl360 merge: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rl360 merge: interrupted", file=sys.stderr)
        return 130
    print(json.dumps(summary.to_dict()) if args.json else summary.text())
    return 0


def _recipe(args: argparse.Namespace, overrides: list[str]) -> R.Recipe:
    if args.recipe is None:
        raise MergeError("give a merge recipe, or --adapter DIR --out OUT")
    return R.load_recipe(args.recipe, overrides)


def _adapter_recipe(args: argparse.Namespace, overrides: list[str]) -> R.Recipe:
    """One adapter onto its base: task arithmetic with lambda 1."""
    from rl360.merge.adapters import ADAPTER_FILES, is_adapter

    if args.recipe is not None:
        raise MergeError("--adapter merges without a recipe: give one or the other")
    if not args.out:
        raise MergeError("--adapter needs --out (the merged model's directory)")
    if not is_adapter(args.adapter):
        raise MergeError(f"--adapter {args.adapter}: no {' and '.join(ADAPTER_FILES)} there")
    base = args.base
    if base is None:
        cfg = json.loads((args.adapter / ADAPTER_FILES[0]).read_text())
        base = cfg.get("base_model_name_or_path") or ""
        if not base:
            raise MergeError(f"--adapter {args.adapter}: its config names no base; give --base")
    raw: dict[str, object] = {"base": str(base), "experts": [{"path": str(args.adapter)}],
                              "method": {"name": "task_arithmetic"}, "output": {"dir": ""}}
    return R.parse_recipe(apply_overrides(raw, overrides))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rl360 merge", description=DESCRIPTION)
    add_arguments(parser)
    return run_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
