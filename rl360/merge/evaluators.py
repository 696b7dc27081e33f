"""Evaluators for greedy soup: a callable `Path -> float` (higher is better).

The recipe form `evaluator = "evals/heldout.toml"` runs `rl360 eval <recipe> --model <dir>`
and reads one number (default key `mean_reward`, dotted paths allowed) from the last JSON
object the command prints on stdout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rl360.merge.errors import MergeError

Evaluator = Callable[[Path], float]


def read_metric(stdout: str, metric: str = "mean_reward") -> float:
    """The number at dotted key `metric` of the last JSON object line of `stdout`."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            value: Any = json.loads(line)
        except json.JSONDecodeError:
            continue
        for key in metric.split("."):
            if not isinstance(value, dict) or key not in value:
                raise MergeError(f"evaluator: the JSON output has no key {metric!r}")
            value = value[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MergeError(f"evaluator: {metric!r} is {value!r}, not a number")
        return float(value)
    raise MergeError("evaluator: `rl360 eval` printed no JSON object")


def rl360_command() -> list[str]:
    """How to call the `rl360` CLI: the venv's script next to this Python, or PATH's."""
    local = Path(sys.executable).with_name("rl360")
    if local.is_file():
        return [str(local)]
    found = shutil.which("rl360")
    if found is None:
        raise MergeError("evaluator: the `rl360` command is not installed")
    return [found]


def recipe_evaluator(
    recipe: str | Path, metric: str = "mean_reward", command: Sequence[str] | None = None
) -> Evaluator:
    """An evaluator that shells out to `rl360 eval <recipe> --model <dir>`."""
    if not Path(recipe).is_file():
        raise MergeError(f"method.evaluator: {recipe} is not a file")

    def score(model_dir: Path) -> float:
        cmd = [*(command or rl360_command()), "eval", str(recipe), "--model", str(model_dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise MergeError(f"evaluator: `{' '.join(cmd)}` exited {proc.returncode}: {tail}")
        return read_metric(proc.stdout, metric)

    return score
