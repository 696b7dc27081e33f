"""`make demo-real`: SmolLM2-135M-Instruct learns tool use in the sandbox, measured on held-out
tasks before and after.

    python examples/tool_tasks/demo_real.py [--recipe recipes/smollm2-tools.toml]
                                            [--name NAME] [--set KEY=VALUE ...]

Every step is an `rl360` command (printed before it runs), so each can be rerun by hand:
1. the tasks: a train and a held-out split (examples/tool_tasks/generate.py)
2. `rl360 eval` of the released model on the held-out split (the baseline)
3. `rl360 sft`: the generic warm start on the tool-call format (the released model writes no
   tool call here, so GRPO would get no signal; examples/tool_tasks/warmstart.py)
4. `rl360 eval` of the warm start on the held-out split
5. `rl360 eval --calibrate` of the warm start on train tasks: the families whose pass rate
   lies in the recipe's band, every train task of those families -> the training file
6. `rl360 train`: asynchronous GRPO with LoRA on that file
7. `rl360 merge --adapter`: the trained adapter into its base, then `rl360 eval` of it on the
   held-out split against the released model (and against the warm start)
It ends with a report (runs/NAME/report.{json,md}, reward_vs_time.png) and one JSON line.
The wall-clock budget is the whole run minus set-up (venv, the model's one-time conversion).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rl360.launch.eval_stats import compare, format_comparison, load_trajectories
from rl360.policies.sft import warm_start_is_current
from rl360.recipe import load_recipe

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def rl360(*args: str, log: Path) -> float:
    """Run one rl360 command (its output to the terminal and `log`); its wall-clock seconds."""
    cmd = [sys.executable, "-m", "rl360", *args]
    print(f"\n$ rl360 {shlex.join(args)}", flush=True)
    t0 = time.monotonic()
    with log.open("ab") as f:
        f.write(f"\n$ rl360 {shlex.join(args)}\n".encode())
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            if not line.startswith(b"\x1b[36m("):  # Ray's per-actor log lines stay in the log
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
        rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"demo-real: `rl360 {shlex.join(args)}` exited {rc}; its log: {log}")
    return time.monotonic() - t0


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "eval_summary.json").read_text())


def newest_adapter(run_dir: Path) -> Path:
    """The model dir of the run's newest checkpoint."""
    ckpts = sorted((run_dir / "checkpoints").glob("*/model"), key=lambda p: p.stat().st_mtime)
    if not ckpts:
        raise SystemExit(f"demo-real: no checkpoint under {run_dir / 'checkpoints'}")
    return ckpts[-1]


def plot(path: Path, metrics: Path, t_train: float, points: list[tuple[str, float, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys = [], []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if row.get("reward_mean") is not None and row.get("elapsed_s") is not None:
            xs.append((t_train + row["elapsed_s"]) / 60)
            ys.append(row["reward_mean"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, ".-", lw=1, ms=3, label="train reward (GRPO batches)")
    for label, minute, p in points:
        lo, hi = p["ci95"]
        ax.errorbar([minute], [p["value"]], yerr=[[p["value"] - lo], [hi - p["value"]]],
                    fmt="o", capsize=4, label=f"held-out pass@1: {label}")
    ax.set_xlabel("minutes since the demo started")
    ax.set_ylabel("reward / pass@1")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("SmolLM2-135M-Instruct, tool tasks: reward over wall-clock")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/smollm2-tools.toml")
    p.add_argument("--name", default="smollm2-tools")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the recipe in every step (repeatable)")
    a = p.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("WANDB_MODE", "offline")
    name = a.name
    out = REPO / "runs" / name
    out.mkdir(parents=True, exist_ok=True)
    log = out / "demo-real.log"
    sets = [x for kv in a.overrides for x in ("--set", kv)]
    t0 = time.monotonic()
    steps: dict[str, float] = {}

    def run(step: str, *args: str) -> None:
        steps[step] = rl360(*args, log=log)
        print(f"demo-real: {step} took {steps[step]:.0f} s ({(time.monotonic() - t0) / 60:.1f} "
              "min so far)", flush=True)

    t = time.monotonic()
    tasks = REPO / "runs" / "tool-tasks"
    subprocess.run([sys.executable, str(HERE / "generate.py"), "--out", str(tasks)], check=True)
    steps["tasks"] = time.monotonic() - t

    def named(run_name: str) -> list[str]:
        return ["--set", f'run.name="{run_name}"']

    run("eval_released", "eval", a.recipe, "--model", "smollm2", *sets, *named(f"{name}-released"))
    recipe = load_recipe(a.recipe, a.overrides)
    if warm_start_is_current(recipe.sft, recipe.run.seed):
        print(f"demo-real: the warm start at {recipe.sft.out} is current (same settings and data)")
        steps["warm_start"] = 0.0
    else:
        run("warm_start", "sft", a.recipe, *sets)
    ws = recipe.sft.out
    run("eval_warm_start", "eval", a.recipe, "--model", ws, *sets, *named(f"{name}-warmstart"),
        "--against", f"runs/{name}-released/eval.jsonl")
    cal = f"runs/{name}-calibration/calibrated_tasks.jsonl"
    run("calibrate", "eval", a.recipe, "--calibrate", "--model", ws, *sets,
        *named(f"{name}-calibration"), "--set", "eval.calibrate_by=\"domain\"",
        "--set", f"eval.tasks={json.dumps(recipe.train.tasks)}",
        "--set", f"eval.per_domain={recipe.eval.per_domain or 8}",
        "--set", f"eval.calibrated_out=\"{cal}\"")
    t_train = time.monotonic() - t0
    run("train", "train", a.recipe, *sets, *named(name), "--set", f"train.tasks=[\"{cal}\"]")
    final = out / "final-model"
    run("merge", "merge", "--adapter", str(newest_adapter(out)), "--out", str(final),
        "--overwrite", "--no-progress")
    run("eval_trained", "eval", a.recipe, "--model", str(final), *sets,
        *named(f"{name}-trained"), "--against", f"runs/{name}-released/eval.jsonl")
    total = time.monotonic() - t0

    runs = REPO / "runs"
    released = summary(runs / f"{name}-released")
    warmstart = summary(runs / f"{name}-warmstart")
    trained = summary(runs / f"{name}-trained")
    vs_warm = compare(load_trajectories(str(runs / f"{name}-warmstart" / "eval.jsonl")),
                      load_trajectories(str(runs / f"{name}-trained" / "eval.jsonl")))
    report = {
        "recipe": a.recipe, "overrides": a.overrides, "minutes": total / 60,
        "step_seconds": steps,
        "held_out": {"released": released["families"], "warm_start": warmstart["families"],
                     "trained": trained["families"]},
        "trained_vs_released": trained["comparison"]["families"],
        "trained_vs_warm_start": vs_warm,
        "calibration": json.loads((runs / f"{name}-calibration" / "calibration.json").read_text())
        .get("domains"),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    md = [f"# {name}: held-out pass@1 ({total / 60:.1f} min, {a.recipe})", "",
          "## trained vs released", "```", format_comparison(report["trained_vs_released"]), "```",
          "", "## trained vs warm start", "```", format_comparison(vs_warm), "```", "",
          "## step seconds", "", *[f"- {k}: {v:.0f}" for k, v in steps.items()]]
    (out / "report.md").write_text("\n".join(md) + "\n")
    pts = [("released", 0.0, released["families"]["all"]["pass@1"]),
           ("warm start", (t_train - steps["calibrate"]) / 60, warmstart["families"]["all"]["pass@1"]),
           ("trained", total / 60, trained["families"]["all"]["pass@1"])]
    plot(out / "reward_vs_time.png", out / "metrics.jsonl", t_train, pts)
    print("\n".join(md))
    allrow = report["trained_vs_released"]["all"]
    print(json.dumps({"demo_real_minutes": round(total / 60, 1),
                      "pass@1_released": allrow["before"], "pass@1_trained": allrow["after"],
                      "delta": allrow["delta"], "cis_overlap": allrow["cis_overlap"],
                      "pass@1_warm_start": warmstart["families"]["all"]["pass@1"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
