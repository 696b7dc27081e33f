"""Where a run's relative output paths land.

Run normally, relative paths (`run.out_dir = "runs"`, `sft.out`, `eval.out`, `train.init`) are
relative to the current directory, as written. A Ray job started with `--working-dir` runs in a
copy of that directory which Ray deletes with the session, so inside such a job (and whenever
RL360_RUNS_ROOT is set) they resolve under a lasting root instead: $RL360_RUNS_ROOT, else
~/rl360. `train.init` moves only when it is not a path inside the working dir (a checked-in
model directory stays where it is; the warm start `rl360 sft` writes moves with `sft.out`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rl360.recipe import Recipe

RUNS_ROOT_ENV = "RL360_RUNS_ROOT"
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray for a job's entrypoint


def in_uploaded_job() -> bool:
    """True when this process is a Ray job's entrypoint running in an uploaded working dir."""
    raw = os.environ.get(JOB_CONFIG_ENV, "")
    if not raw:
        return False
    try:
        runtime_env = json.loads(raw).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return False
    return bool(runtime_env.get("working_dir"))


def runs_root() -> Path | None:
    """The root for relative output paths, or None to leave them relative to the cwd."""
    explicit = os.environ.get(RUNS_ROOT_ENV, "")
    if explicit:
        return Path(explicit).expanduser().resolve()
    if in_uploaded_job():
        return Path.home() / "rl360"
    return None


def _rebase(path: str, root: Path) -> str:
    if not path or Path(path).is_absolute():
        return path
    return str(root / path)


def resolve_run_paths(recipe: Recipe) -> str:
    """Rebases the recipe's relative output paths in place; returns a one-line note of what
    moved ("" when nothing did)."""
    root = runs_root()
    if root is None:
        return ""
    moved_init = (recipe.train.init and not Path(recipe.train.init).is_absolute()
                  and not Path(recipe.train.init).exists())
    recipe.run.out_dir = _rebase(recipe.run.out_dir, root)
    recipe.sft.out = _rebase(recipe.sft.out, root)
    recipe.eval.out = _rebase(recipe.eval.out, root)
    if moved_init:
        recipe.train.init = _rebase(recipe.train.init, root)
    why = (f"{RUNS_ROOT_ENV} is set" if os.environ.get(RUNS_ROOT_ENV)
           else f"a Ray job's working dir is deleted with the session; set {RUNS_ROOT_ENV} to choose")
    return (f"rl360: relative output paths resolve under {root} ({why}): "
            f"run.out_dir {recipe.run.out_dir}")
