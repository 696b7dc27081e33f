"""Evaluators for greedy soup: a callable `Path -> float` (higher is better).

The recipe form `evaluator = "recipes/heldout-eval.toml"` runs
`rl360 eval <recipe> --model <dir> --set run.out_dir=<tmp> --set run.name=greedy-soup` and reads
one number from the JSON summary that command writes (`<tmp>/greedy-soup/eval_summary.json`),
or failing that from the last JSON object it prints. The number is found at the dotted key
`metric` (default `mean_reward`), looked up at the top level and then under `overall`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rl360.merge.errors import MergeError

Evaluator = Callable[[Path], float]
RUN_NAME = "greedy-soup"


def metric_of(data: Any, metric: str = "mean_reward") -> float:
    """The number at dotted key `metric` of `data` (or of `data["overall"]`)."""
    for root in (data, data.get("overall") if isinstance(data, dict) else None):
        value = root
        for key in metric.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise MergeError(f"evaluator: {metric!r} is {value!r}, not a number")
            return float(value)
    raise MergeError(f"evaluator: the eval summary has no key {metric!r}")


def read_metric(stdout: str, metric: str = "mean_reward") -> float:
    """The metric from the last JSON object line of `stdout`."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return metric_of(json.loads(line), metric)
            except json.JSONDecodeError:
                continue
    raise MergeError("evaluator: `rl360 eval` wrote no summary and printed no JSON object")


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
        with tempfile.TemporaryDirectory(prefix="rl360-greedy-eval-") as tmp:
            cmd = [
                *(command or rl360_command()), "eval", str(recipe), "--model", str(model_dir),
                "--set", f"run.out_dir={json.dumps(tmp)}", "--set", f"run.name={json.dumps(RUN_NAME)}",
            ]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise MergeError(
                    f"evaluator: `{' '.join(cmd[:5])}` exited {proc.returncode}: {tail}"
                )
            summary = Path(tmp, RUN_NAME, "eval_summary.json")
            if summary.is_file():
                return metric_of(json.loads(summary.read_text()), metric)
            return read_metric(proc.stdout, metric)

    return score
