"""The run's one metrics stream: terminal progress, JSONL, wandb (offline by default), Ray
metrics (so the Ray dashboard / Prometheus show rollout and training gauges) and, at the end,
a reward-curve PNG."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

_GAUGES = ("reward_mean", "pass_rate", "loss", "grad_norm", "staleness_mean", "trainer_idle_frac",
           "engine_idle_frac", "gen_tokens_per_s", "train_tokens_per_s", "sync_s", "policy_version")


class MetricsSink:
    def __init__(self, run_dir: Path, run_name: str, total_steps: int, wandb_mode: str,
                 config: dict[str, Any], resume: bool = False) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.total = total_steps
        self.t0 = time.monotonic()
        self.first_step: int | None = None
        self._parked_seen = False  # a step logged tasks_parked > 0: show the all-task reward
        self.rows: list[dict[str, Any]] = []
        if resume and self.path.exists():
            self.rows = [json.loads(line) for line in self.path.open() if line.strip()]
        self._file = self.path.open("a" if resume else "w")
        self._wandb = _start_wandb(run_dir, run_name, wandb_mode, config)
        self._gauges: dict[str, Any] = {}
        try:
            from ray.util.metrics import Gauge

            for k in _GAUGES:
                self._gauges[k] = Gauge(f"rl360_{k}", f"RL360 training: {k}", tag_keys=("run",))
        except Exception:  # outside a Ray session: no gauges
            self._gauges = {}
        self.run_name = run_name

    def log(self, row: dict[str, Any]) -> None:
        row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.rows.append(row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, int | float)}, step=row["step"])
        for k, g in self._gauges.items():
            v = row.get(k)
            if isinstance(v, int | float):
                g.set(float(v), tags={"run": self.run_name})
        self._progress(row)

    def _progress(self, row: dict[str, Any]) -> None:
        step = row["step"]
        if isinstance(row.get("eval/reward_mean"), int | float):
            print(f"eval (policy of step {row.get('eval/step', '?')}, {row.get('eval/episodes', 0)} "
                  f"tasks): reward {row['eval/reward_mean']:.3f}  pass@1 "
                  f"{row.get('eval/pass@1') or 0.0:.3f}", flush=True)
        if "reward_mean" not in row:  # an eval-only row (the evaluation that ended last)
            return
        if self.first_step is None:
            self.first_step = step
            self.t0 = time.monotonic() - row.get("step_s", 0.0)
        done = step - self.first_step + 1
        elapsed = time.monotonic() - self.t0
        eta = elapsed / done * (self.total - step) if done else float("nan")
        fmt = lambda k, f: format(row[k], f) if isinstance(row.get(k), int | float) else "-"  # noqa: E731
        # once a task was parked the batch's mix moves: the all-task figure is shown beside it
        self._parked_seen = self._parked_seen or bool(row.get("tasks_parked"))
        tasks = (f" (all tasks {fmt('task_reward_mean', '.3f')}, {row.get('tasks_parked', 0)} "
                 "parked)" if self._parked_seen else "")
        print(f"step {step:>4}/{self.total}  reward {fmt('reward_mean', '.3f')}{tasks}  "
              f"pass {fmt('pass_rate', '.3f')}  loss {fmt('loss', '+.4f')}  "
              f"gen {fmt('gen_tokens_per_s', '.0f')} tok/s  staleness {fmt('staleness_mean', '.2f')}  "
              f"trainer idle {fmt('trainer_idle_frac', '.0%')}  "
              f"{elapsed:6.0f}s  ETA {eta:5.0f}s", flush=True)

    def close(self) -> Path | None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        return plot_curve(self.rows, self.run_dir / "reward_curve.png")


def _start_wandb(run_dir: Path, name: str, mode: str, config: dict[str, Any]) -> Any:
    if mode == "disabled":
        return None
    if mode == "online" and not os.environ.get("WANDB_API_KEY"):
        print("rl360: train.wandb='online' but WANDB_API_KEY is not set; logging offline",
              file=sys.stderr)
        mode = "offline"
    wdir = run_dir / "wandb"
    for var, sub in (("WANDB_DIR", ""), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        (wdir / sub).mkdir(parents=True, exist_ok=True)
        os.environ.setdefault(var, str(wdir / sub))
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        import wandb

        return wandb.init(project="rl360", name=name, mode=mode, dir=str(wdir), config=config,
                          reinit="finish_previous")
    except Exception as exc:  # metrics must not stop training
        print(f"rl360: wandb disabled ({exc!r})", file=sys.stderr)
        return None


def domain_lines(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """(step, reward mean) per domain from the rows' `domain/<d>/reward_mean` keys."""
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for k, v in r.items():
            if (k.startswith("domain/") and k.endswith("/reward_mean")
                    and isinstance(v, int | float) and math.isfinite(v)):
                lines.setdefault(k[len("domain/"):-len("/reward_mean")], []).append((r["step"], v))
    return dict(sorted(lines.items()))


def parked_run(rows: list[dict[str, Any]]) -> bool:
    """A step of the run had a task parked: the batch's mix moved, so the all-task reward
    (`task_reward_mean`), not the batch's, tells how the run went."""
    return any(r.get("tasks_parked") for r in rows)


def plot_curve(rows: list[dict[str, Any]], out: Path) -> Path | None:
    pts = [(r["step"], r["reward_mean"]) for r in rows if isinstance(r.get("reward_mean"), int | float)]
    if not pts:
        return None
    parked = parked_run(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", lw=1.2,
            label="mean reward (batch)" if parked else "mean reward")
    if parked:  # the batch's mix moved: every task once at its latest group
        tr = [(r["step"], r["task_reward_mean"]) for r in rows
              if isinstance(r.get("task_reward_mean"), int | float)]
        ax.plot([p[0] for p in tr], [p[1] for p in tr], lw=1.4, label="all-task reward")
    pr = [(r["step"], r["pass_rate"]) for r in rows if isinstance(r.get("pass_rate"), int | float)]
    if pr:
        ax.plot([p[0] for p in pr], [p[1] for p in pr], lw=1.0, alpha=0.7, label="pass rate")
    for name, line in domain_lines(rows).items():
        ax.plot([p[0] for p in line], [p[1] for p in line], lw=0.9, alpha=0.8, ls="--",
                label=f"{name} reward")
    ev = [(r["step"], r["eval/reward_mean"]) for r in rows
          if isinstance(r.get("eval/reward_mean"), int | float)]
    if ev:
        ax.plot([p[0] for p in ev], [p[1] for p in ev], marker="o", lw=1.0, label="eval reward")
    ax.set_xlabel("training step (rollout iteration)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title("RL360 training reward")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
