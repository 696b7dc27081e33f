"""`rl360 plot`: several runs' reward on one axis, against wall-clock time or step.

Reads each run's `metrics.jsonl` (a run directory or the file itself), draws `reward_mean`
(or `--metric`, e.g. `task_reward_mean` for runs that park tasks) per step against
`elapsed_s` (seconds since the run started: Ray, Serve and the actors included) or the step
number, and prints, per run, the first step and time at which the
reward reached `--target`: e.g. the CPU demo's async and sync runs (docs/demo.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunCurve:
    label: str
    steps: list[int]
    seconds: list[float]
    rewards: list[float]

    def first_reaching(self, target: float) -> tuple[int, float] | None:
        """(step, elapsed seconds) of the first row with reward >= target; None if never."""
        for step, sec, r in zip(self.steps, self.seconds, self.rewards, strict=True):
            if r >= target:
                return step, sec
        return None


def metrics_path(run: str) -> Path:
    p = Path(run)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise FileNotFoundError(f"no metrics.jsonl at {run!r} (give a run directory or the file)")
    return p


def read_curve(path: Path, label: str, metric: str = "reward_mean") -> RunCurve:
    """The run's reward (`metric`) per step; `elapsed_s` (or, in runs that predate it, the
    running sum of `step_s`) as the time of each step."""
    steps: list[int] = []
    seconds: list[float] = []
    rewards: list[float] = []
    running = 0.0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
        running += float(row.get("step_s") or 0.0)
        r = row.get(metric)
        if not isinstance(r, int | float) or not math.isfinite(r):
            continue
        steps.append(int(row["step"]))
        t = row.get("elapsed_s")
        seconds.append(float(t) if isinstance(t, int | float) else running)
        rewards.append(float(r))
    return RunCurve(label, steps, seconds, rewards)


def plot(curves: list[RunCurve], out: Path, x: str, target: float | None, title: str,
         ylabel: str = "mean reward") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for c in curves:
        xs = [s / 60.0 for s in c.seconds] if x == "time" else c.steps
        ax.plot(xs, c.rewards, lw=1.2, marker=".", markersize=3, label=c.label)
        hit = c.first_reaching(target) if target is not None else None
        if hit is not None:
            hx = hit[1] / 60.0 if x == "time" else hit[0]
            ax.axvline(hx, lw=0.8, ls=":", color=ax.lines[-1].get_color())
    if target is not None:
        ax.axhline(target, lw=0.8, ls="--", color="gray", label=f"target {target:g}")
    ax.set_xlabel("minutes since the run started" if x == "time" else "training step")
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="run directories (or their metrics.jsonl)")
    p.add_argument("--labels", default="", help="comma-separated legend labels (default: names)")
    p.add_argument("--x", choices=["time", "step"], default="time", help="x axis (default: time)")
    p.add_argument("--metric", default="reward_mean",
                   help="the metrics.jsonl key to draw (default reward_mean; task_reward_mean: "
                        "every task once at its latest group, for runs that park tasks)")
    p.add_argument("--target", type=float, default=None, help="draw and report this reward")
    p.add_argument("--title", default="RL360 mean reward", help="plot title")
    p.add_argument("--out", default="reward_runs.png", help="PNG to write")


def plot_command(args: argparse.Namespace) -> int:
    labels = [s for s in args.labels.split(",") if s] if args.labels else []
    try:
        if labels and len(labels) != len(args.runs):
            raise ValueError(f"--labels: {len(labels)} labels for {len(args.runs)} runs")
        curves = [read_curve(metrics_path(run), labels[i] if labels else Path(run).name,
                             args.metric)
                  for i, run in enumerate(args.runs)]
    except (OSError, ValueError) as exc:
        print(f"rl360 plot: {exc}", file=sys.stderr)
        return 2
    for c in curves:
        if not c.rewards:
            print(f"{c.label}: no steps with {args.metric}")
            continue
        line = f"{c.label}: {len(c.steps)} steps, {c.seconds[-1]:.0f} s, best {max(c.rewards):.3f}"
        if args.target is not None:
            hit = c.first_reaching(args.target)
            line += (f", first >= {args.target:g} at step {hit[0]} ({hit[1]:.0f} s)" if hit
                     else f", never >= {args.target:g}")
        print(line)
    ylabel = "mean reward" if args.metric == "reward_mean" else args.metric
    out = plot(curves, Path(args.out), args.x, args.target, args.title, ylabel)
    print(f"wrote {out}")
    return 0
