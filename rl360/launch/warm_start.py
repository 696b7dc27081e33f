"""The warm start: `rl360 sft` on its own, and the step `rl360 train` takes before RL when
`train.init` is the recipe's own `sft.out` (made, or made again when its [sft] settings or data
changed since, unless a checkpoint already carries the model)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rl360.policies.sft import run_sft, warm_start_is_current
from rl360.recipe import Recipe


class WarmStartError(RuntimeError):
    """train.init names no usable model directory."""


def sft_command(recipe: Recipe, args: argparse.Namespace) -> int:
    """`rl360 sft recipe.toml`: supervised fine-tuning on the recipe's [sft] chats."""
    stats = run_sft(recipe.sft, seed=recipe.run.seed, chat_template=recipe.model.chat_template)
    print(f"sft: {stats['samples']} chats, final loss {stats['loss']:.4f}, "
          f"{stats['seconds']:.1f}s -> {recipe.sft.out}")
    return 0


def ensure_warm_start(recipe: Recipe, resuming: bool) -> str:
    """The model RL starts from: `train.init` (made first by `rl360 sft` when it is the
    recipe's own sft.out and is missing or stale), else `model.path`."""
    init = recipe.train.init
    if not init:
        return recipe.model.path
    if recipe.sft.out == init and not resuming:  # a checkpoint carries its own model
        if not warm_start_is_current(recipe.sft, recipe.run.seed):
            why = (f"no warm start at {init}" if not (Path(init) / "config.json").is_file()
                   else f"the warm start at {init} was made from other [sft] settings or data")
            print(f"rl360: {why}: running `rl360 sft` first", file=sys.stderr)
            stats = run_sft(recipe.sft, seed=recipe.run.seed, chat_template=recipe.model.chat_template)
            print(f"rl360: warm start done: loss {stats['loss']:.4f} in {stats['seconds']:.0f}s")
    if not (Path(init) / "config.json").is_file():
        raise WarmStartError(f"train.init {init!r} is not a model directory; create it first "
                             "(`rl360 sft <recipe>` writes the warm start to sft.out)")
    return init
