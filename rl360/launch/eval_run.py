"""`rl360 eval`: every task x n attempts on the current policy, through engines, sessions
and env actors; a per-task table (mean reward, pass@1, pass@k), every trajectory as JSONL,
and with --calibrate the per-task pass rates and a task list inside a pass-rate band."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec

from rl360.envs.api import TaskRefused, choose_backend
from rl360.envs.registry import build_env_for
from rl360.envs.tasks import iter_tasks
from rl360.launch.eval_stats import (
    compare,
    family_report,
    format_comparison,
    format_family_report,
    load_trajectories,
    passed,
)
from rl360.launch.stack import running_stack
from rl360.ray_session import STOP
from rl360.recipe import Recipe
from rl360.types import Task, Trajectory


def load_tasks(recipe: Recipe, everything: bool = False) -> list[Task]:
    """The tasks of `eval.tasks`: the first `eval.per_domain` of each domain, then the first
    `eval.limit` (everything=True: all of them)."""
    tasks: list[Task] = []
    for path in recipe.eval.tasks:
        tasks.extend(iter_tasks(path))
    if everything:
        return tasks
    if recipe.eval.per_domain:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for t in tasks:
            dom = str(t.data.get("domain", ""))
            if seen[dom] < recipe.eval.per_domain:
                seen[dom] += 1
                kept.append(t)
        tasks = kept
    if recipe.eval.limit:
        tasks = tasks[: recipe.eval.limit]
    return tasks


def refuse_unrunnable(recipe: Recipe, tasks: list[Task]) -> tuple[list[Task], list[str]]:
    """Tasks this host cannot run (e.g. a container image without Docker), refused up front."""

    ok, refused = [], []
    for t in tasks:
        try:
            env = build_env_for(recipe.env.env, recipe.env.params, t.kind)
            choose_backend(env.sandbox_spec(t, recipe.env.limits), recipe.env.sandbox, t,
                           recipe.env.allow_unsandboxed)
            ok.append(t)
        except TaskRefused as exc:
            refused.append(str(exc))
    return ok, refused


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def summarize(trajs: list[Trajectory], k: int) -> dict[str, Any]:
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_task[t.task_id or "?"].append(t)
    rows = []
    for task_id, ts in sorted(by_task.items()):
        scored = [t for t in ts if t.status != "infra_error" and t.reward is not None]
        n, c = len(scored), sum(passed(t) for t in scored)
        rows.append({
            "task": task_id,
            "n": n,
            "infra_errors": len(ts) - n,
            "infra_rate": (len(ts) - n) / len(ts),  # of the attempts: unscored, never a 0
            "mean_reward": sum(t.reward.value for t in scored) / n if n else float("nan"),  # type: ignore[union-attr]
            "pass@1": c / n if n else float("nan"),
            f"pass@{k}": pass_at_k(n, c, min(k, n)) if n else float("nan"),
        })
    valid = [r for r in rows if r["n"]]
    overall = {
        "tasks": len(rows),
        "episodes": len(trajs),
        "infra_errors": sum(r["infra_errors"] for r in rows),
        "infra_rate": sum(r["infra_errors"] for r in rows) / len(trajs) if trajs else 0.0,
        "mean_reward": sum(r["mean_reward"] for r in valid) / len(valid) if valid else float("nan"),
        "pass@1": sum(r["pass@1"] for r in valid) / len(valid) if valid else float("nan"),
        f"pass@{k}": sum(r[f"pass@{k}"] for r in valid) / len(valid) if valid else float("nan"),
    }
    return {"rows": rows, "overall": overall}


def format_table(summary: dict[str, Any], k: int) -> str:
    head = (f"{'task':<32} {'n':>3} {'infra':>5} {'infra%':>6} {'reward':>7} {'pass@1':>7} "
            f"{f'pass@{k}':>7}")
    lines = [head, "-" * len(head)]
    for r in summary["rows"]:
        lines.append(f"{r['task'][:32]:<32} {r['n']:>3} {r['infra_errors']:>5} "
                     f"{100 * r['infra_rate']:>5.1f}% "
                     f"{r['mean_reward']:>7.3f} {r['pass@1']:>7.3f} {r[f'pass@{k}']:>7.3f}")
    o = summary["overall"]
    lines.append("-" * len(head))
    lines.append(f"{'overall (' + str(o['tasks']) + ' tasks)':<32} {o['episodes']:>3} "
                 f"{o['infra_errors']:>5} {100 * o['infra_rate']:>5.1f}% {o['mean_reward']:>7.3f} "
                 f"{o['pass@1']:>7.3f} {o[f'pass@{k}']:>7.3f}")
    return "\n".join(lines)


def collect(refs: list[Any], desc: str) -> list[Trajectory]:
    """Wait for trajectory refs with a progress bar, in completion order."""
    import ray
    from tqdm import tqdm


    out: list[Trajectory] = []
    pending = list(refs)
    with tqdm(total=len(refs), desc=desc, unit="ep", file=sys.stderr, dynamic_ncols=True) as bar:
        while pending and not STOP.requested:
            done, pending = ray.wait(pending, num_returns=min(len(pending), 16), timeout=1.0)
            for t in ray.get(done):
                out.append(t)
            bar.update(len(done))
            if out:
                ok = [t for t in out if t.reward is not None]
                if ok:
                    bar.set_postfix(reward=f"{sum(t.reward.value for t in ok) / len(ok):.3f}")  # type: ignore[union-attr]
    return out


def eval_command(recipe: Recipe, args: argparse.Namespace) -> int:
    """`rl360 eval recipe.toml [--model DIR] [--calibrate] [--against EVAL_JSONL]`."""
    if args.model:
        recipe.model.path = args.model
    return run_eval(recipe, calibrate=args.calibrate, against=getattr(args, "against", None))


def run_eval(recipe: Recipe, calibrate: bool = False, against: str | None = None) -> int:

    tasks, refused = refuse_unrunnable(recipe, load_tasks(recipe))
    for why in refused:
        print(f"rl360: skipping: {why}", file=sys.stderr)
    if not tasks:
        print("rl360: no runnable tasks", file=sys.stderr)
        return 2
    run_dir = Path(recipe.run.out_dir) / recipe.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    out_path = Path(recipe.eval.out) if recipe.eval.out else run_dir / "eval.jsonl"
    k = recipe.eval.attempts
    with running_stack(recipe) as stack:
        pool = stack.pool
        assert pool is not None  # running_stack starts env actors by default
        t0 = time.monotonic()
        refs = [pool.submit(t, group_id=f"{t.id}") for t in tasks for _ in range(k)]
        trajs = collect(refs, f"eval {len(tasks)} tasks x {k}")
        wall = time.monotonic() - t0
        engines = stack.serving.weight_status().get("engines", {})
    with out_path.open("wb") as f:
        for t in trajs:
            f.write(msgspec.json.encode(t) + b"\n")
    summary = summarize(trajs, k)
    print(format_table(summary, k))
    gen_tokens = sum(sum(t.mask) for t in trajs)
    print(f"{len(trajs)} episodes in {wall:.1f}s ({len(trajs) / wall:.1f} ep/s, "
          f"{gen_tokens / wall:.0f} generated tok/s); trajectories: {out_path}")
    for rep, h in sorted(engines.items()):
        print(f"engine {rep}: {h.get('batches', 0)} batches, {h.get('requests', 0)} requests, "
              f"busy {h.get('busy_s', 0.0):.1f}s of {h.get('uptime_s', 0.0):.1f}s")
    families = family_report(trajs, seed=recipe.run.seed)
    print(format_family_report(families))
    summary["families"] = families
    if against:
        cmp = compare(load_trajectories(against), trajs, seed=recipe.run.seed)
        print(f"against {against}:")
        print(format_comparison(cmp))
        summary["comparison"] = {"before": against, "families": cmp}
    (run_dir / "eval_summary.json").write_text(json.dumps(summary, indent=2))
    if calibrate:
        write_calibration(summary, tasks, recipe, run_dir)
    return 0


def task_record(task: Task) -> dict[str, Any]:
    """A task as a full JSONL record (rl360.envs.tasks reads it back as the same Task)."""
    return {"id": task.id, "prompt": task.prompt, "kind": task.kind, "data": task.data}


def write_calibration(summary: dict[str, Any], tasks: list[Task], recipe: Recipe,
                      run_dir: Path) -> Path:
    """Keep the tasks whose pass rate (passes / scored attempts, out of eval.attempts) lies in
    [eval.band_low, eval.band_high] (`eval.calibrate_by = "domain"`: every task of a domain
    whose pooled rate does): their full records go to a task file that works as `train.tasks`
    as it is; calibration.json reports every task's (and domain's) rate. Returns the file."""
    e = recipe.eval
    lo, hi = e.band_low, e.band_high
    rows = {r["task"]: r for r in summary["rows"]}
    report = []
    keep = []
    pooled: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # passes, scored
    for t in tasks:
        r = rows.get(t.id)
        if r and r["n"]:
            dom = pooled[str(t.data.get("domain", ""))]
            dom[0] += r["pass@1"] * r["n"]
            dom[1] += r["n"]
    domains = {d: (p / n if n else None) for d, (p, n) in pooled.items()}
    kept_domains = {d for d, rate in domains.items() if rate is not None and lo <= rate <= hi}
    for t in tasks:
        r = rows.get(t.id)
        rate = r["pass@1"] if r and r["n"] else None
        inside = rate is not None and lo <= rate <= hi
        report.append({"task": t.id, "kind": t.kind, "pass_rate": rate,
                       "scored": r["n"] if r else 0, "infra_errors": r["infra_errors"] if r else 0,
                       "kept": inside})
        if inside and e.calibrate_by == "task":
            keep.append(t)
    if e.calibrate_by == "domain":
        keep = [t for t in load_tasks(recipe, everything=True)
                if str(t.data.get("domain", "")) in kept_domains]
    out = Path(e.calibrated_out) if e.calibrated_out else run_dir / "calibrated_tasks.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "calibration.json").write_text(json.dumps(
        {"attempts": e.attempts, "band": [lo, hi], "kept": len(keep), "tasks": len(tasks),
         "task_file": str(out), "by": e.calibrate_by, "domains": domains,
         "kept_domains": sorted(kept_domains), "rates": report}, indent=2))
    with out.open("wb") as f:
        for t in keep:
            f.write(msgspec.json.encode(task_record(t)) + b"\n")
    if e.calibrate_by == "domain":
        rates = ", ".join(f"{d} {r:.3f}" for d, r in sorted(domains.items()) if r is not None)
        print(f"calibration by domain: {rates}; kept {sorted(kept_domains)} (pass rate in "
              f"[{lo}, {hi}] over {e.attempts} attempts): {len(keep)} tasks -> {out}")
    else:
        print(f"calibration: {len(keep)}/{len(tasks)} tasks with pass rate in [{lo}, {hi}] "
              f"over {e.attempts} attempts -> {out} (use as train.tasks; every rate: "
              f"{run_dir / 'calibration.json'})")
    return out
