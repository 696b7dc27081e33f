"""Async speedup: the same recipe and number of steps with max_staleness = 0 (synchronous)
and = 2 (fully asynchronous), on episodes of uneven length (a long tail, as real agent tasks
have: the synthetic env sleeps a lognormal time per episode), with the real engines, session
shards, env actors, buffer, trainer and weight publishing.

    .venv/bin/python bench/async_speedup.py [--steps 8] [--sigma 1.0] [--median 0.3]

Last line: {"bench": "async_speedup", "ours": <async s>, "baseline": <sync s>, "ratio": <sync/async>}
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def run(staleness: int, args: argparse.Namespace, out: Path) -> tuple[float, float]:
    from rl360.launch.train_run import run_train
    from rl360.recipe import apply_overrides, decode_recipe

    recipe = decode_recipe(apply_overrides({}, [
        f"run.name=s{staleness}", f"run.out_dir={json.dumps(str(out))}", "model.path='tiny'",
        "ray.dashboard=false", "ray.num_cpus=2", "env.env='synthetic'", "env.actors=2",
        "env.episodes_per_actor=64", "engine.num_cpus=0.5", "trainer.num_cpus=0.5",
        f"train.steps={args.steps}", "train.group_size=4", "train.groups_per_batch=8",
        f"train.max_staleness={staleness}", "train.max_in_flight_groups=24",
        "train.tasks=['examples/tasks/code.jsonl']", "train.sampling.max_tokens=8",
        "train.checkpoint_every=0", "train.wandb='disabled'", "trainer.lr=1e-4",
    ]))
    t0 = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()):
        run_train(recipe)
    wall = time.monotonic() - t0
    rows = [json.loads(x) for x in (out / f"s{staleness}" / "metrics.jsonl").open()]
    steps_s = sum(r["step_s"] for r in rows)
    idle = sum(r["wait_s"] for r in rows) / steps_s if steps_s else float("nan")
    print(f"max_staleness={staleness}: {steps_s:.1f}s for {len(rows)} steps "
          f"({wall:.0f}s with start-up), trainer idle {idle:.0%}, "
          f"staleness max {max(r['staleness_max'] for r in rows):.0f}", flush=True)
    return steps_s, idle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        sync_s, sync_idle = run(0, args, Path(d))
        async_s, async_idle = run(2, args, Path(d))
    print(json.dumps({"bench": "async_speedup", "ours": round(async_s, 2),
                      "baseline": round(sync_s, 2), "ratio": round(sync_s / async_s, 2),
                      "trainer_idle_sync": round(sync_idle, 3),
                      "trainer_idle_async": round(async_idle, 3)}))


if __name__ == "__main__":
    main()
