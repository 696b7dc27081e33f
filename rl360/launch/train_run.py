"""`rl360 train`: the fully asynchronous RL loop of DESIGN.md, end to end.

engines + session server (Serve) <- env actors <- rollout controller -> trajectory buffer
-> trainer group -> weights published to every engine replica, while rollouts continue up to
`train.max_staleness` versions behind (0: synchronous on-policy).

Checkpoints (every `train.checkpoint_every` steps and at the end) hold the policy as HF
safetensors, the optimizer/step/RNG state, the buffer's queued groups and the controller's
position in the task stream; `--resume` continues from the newest one, so a run killed with
`kill -9` loses only the episodes that were in flight and the steps after that checkpoint.
"""

from __future__ import annotations

import collections
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from rl360.recipe import Recipe

if TYPE_CHECKING:
    from rl360.launch.stack import Stack

CKPT_META = "rl360_checkpoint.json"


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = sorted(p.parent for p in (run_dir / "checkpoints").glob(f"step_*/{CKPT_META}"))
    return done[-1] if done else None


def staleness_stats(batch: Any) -> tuple[dict[str, int], float, float]:
    hist: collections.Counter[int] = collections.Counter()
    for s in batch.samples:
        for v, m in zip(s.versions, s.mask, strict=True):
            if m:
                hist[batch.policy_version - v] += 1
    n = sum(hist.values())
    mean = sum(k * c for k, c in hist.items()) / n if n else 0.0
    return {str(k): c for k, c in sorted(hist.items())}, mean, float(max(hist) if hist else 0)


@dataclass
class TrainActors:
    trainer: Any  # actors.trainer_group.TrainerGroup
    buffer: Any  # ActorHandle[TrajectoryBuffer]
    controller: Any  # ActorHandle[RolloutController]


def start_train_actors(recipe: Recipe, stack: Stack, model_path: Any) -> TrainActors:
    """The trainer ranks (on the placement's train options), the trajectory buffer and the
    rollout controller (service role), wired to the stack's env actors and publisher."""
    import ray

    from rl360.actors.buffer import TrajectoryBuffer
    from rl360.actors.controller import RolloutController
    from rl360.actors.trainer_group import TrainerGroup

    tr, t, placement = recipe.train, recipe.trainer, stack.placement
    if stack.pool is None:
        raise ValueError("start_train_actors needs a stack with env actors")
    trainer = TrainerGroup(t, model_path, temperature=tr.sampling.temperature or 1.0,
                           seed=recipe.run.seed, rank_options=placement.trainer_options)
    service = placement.service_options()
    buffer = ray.remote(TrajectoryBuffer).options(
        name="rl360-trajectory-buffer", **service).remote(tr, t.advantage)
    controller = ray.remote(RolloutController).options(
        name="rl360-rollout-controller", max_concurrency=1000, **service).remote(
            tr, recipe.engine.replicas, stack.pool.actors, buffer, stack.serving.publisher)
    ray.get([buffer.size.remote(), controller.status.remote()])  # up, or raise here
    return TrainActors(trainer=trainer, buffer=buffer, controller=controller)


def run_train(recipe: Recipe, resume: bool = False) -> int:
    import ray

    from rl360.actors.metrics import MetricsSink
    from rl360.launch.paths import resolve_run_paths
    from rl360.launch.stack import running_stack
    from rl360.policies.loading import resolve_model_path
    from rl360.serve.weights.transports import build_transport

    if note := resolve_run_paths(recipe):
        print(note, file=sys.stderr)
    tr = recipe.train
    run_dir = Path(recipe.run.out_dir) / recipe.run.name
    ckpt = latest_checkpoint(run_dir) if resume else None
    if resume and ckpt is None:
        print(f"rl360: --resume: no checkpoint under {run_dir / 'checkpoints'}; starting fresh",
              file=sys.stderr)
    if not resume and (run_dir / "checkpoints").exists():
        print(f"rl360: {run_dir} has checkpoints from an earlier run; use --resume to continue "
              "or another run.name", file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = json.loads((ckpt / CKPT_META).read_text()) if ckpt else {}
    if tr.init:
        if recipe.sft.out == tr.init and ckpt is None:  # a checkpoint carries its own model
            from rl360.policies.sft import run_sft, warm_start_is_current

            if not warm_start_is_current(recipe.sft, recipe.run.seed):
                why = (f"no warm start at {tr.init}"
                       if not (Path(tr.init) / "config.json").is_file()
                       else f"the warm start at {tr.init} was made from other [sft] settings or data")
                print(f"rl360: {why}: running `rl360 sft` first", file=sys.stderr)
                stats = run_sft(recipe.sft, seed=recipe.run.seed)
                print(f"rl360: warm start done: loss {stats['loss']:.4f} in "
                      f"{stats['seconds']:.0f}s")
        if not (Path(tr.init) / "config.json").is_file():
            print(f"rl360: train.init {tr.init!r} is not a model directory; create it first "
                  "(`rl360 sft <recipe>` writes the warm start to sft.out)", file=sys.stderr)
            return 2
        recipe.model.path = tr.init  # engines and trainer start from the warm start
    # the time budget counts from here: Ray, Serve, the actors and every step (a warm start
    # made above is a one-time cost, cached for later runs)
    deadline = time.monotonic() + tr.max_minutes * 60 if tr.max_minutes else None
    model_path = resolve_model_path(recipe.model.path)
    step0, version = int(meta.get("step", 0)), int(meta.get("version", 0))
    (run_dir / "recipe.json").write_text(json.dumps(msgspec.to_builtins(recipe), indent=2))

    with running_stack(recipe, sampling=msgspec.to_builtins(tr.sampling)) as stack:
        serving = stack.serving
        actors = start_train_actors(recipe, stack, ckpt / "model" if ckpt else model_path)
        trainer, buffer, controller = actors.trainer, actors.buffer, actors.controller
        transport = build_transport(tr.weight_sync, serving, trainer, recipe.engine.replicas)
        sink = MetricsSink(run_dir, recipe.run.name, tr.steps, tr.wandb,
                           msgspec.to_builtins(recipe), resume=ckpt is not None)
        try:
            if ckpt is not None:
                ray.get(buffer.load_state.remote((ckpt / "buffer.msgpack").read_bytes()))
                transport.publish(version)
                print(f"rl360: resumed from {ckpt} (step {step0}, policy version {version})",
                      file=sys.stderr)
            ray.get(controller.start.remote(int(meta.get("groups_started", 0)),
                                            int(meta.get("tasks_taken", 0))))
            _loop(recipe, run_dir, trainer, serving, transport, buffer, controller, sink, step0,
                  version, deadline)
        finally:
            try:
                ray.get(controller.stop.remote(), timeout=30)
            except Exception as exc:
                print(f"rl360: controller stop: {exc!r}", file=sys.stderr)
            png = sink.close()
            trainer.shutdown()  # env actors, Serve app and placement groups: by running_stack
            if png:
                print(f"rl360: reward curve -> {png}")
    _print_curve(sink.rows)
    return 0


def _loop(recipe: Recipe, run_dir: Path, trainer: Any, serving: Any, transport: Any,
          buffer: Any, controller: Any, sink: Any, step0: int, version: int,
          deadline: float | None = None) -> None:
    import ray

    from rl360.ray_session import STOP

    tr = recipe.train
    last_engine: dict[str, dict[str, Any]] = {}
    for step in range(step0 + 1, tr.steps + 1):
        t0 = time.monotonic()
        batch = None
        while batch is None and not STOP.requested:
            batch = ray.get(buffer.next_batch.remote(version, step, 2.0))
            if batch is None:  # surface a dead controller instead of waiting forever
                ray.get(controller.status.remote())
        if batch is None:  # stopped by Ctrl-C / SIGTERM: keep what was learned
            if step > step0 + 1:
                path = save_checkpoint(run_dir, step - 1, version, trainer, buffer,
                                       ray.get(controller.status.remote()), tr.keep_checkpoints)
                print(f"rl360: stopped; checkpoint {path} (continue with --resume)")
            return
        t_wait = time.monotonic() - t0
        hist, st_mean, st_max = staleness_stats(batch)
        m = trainer.train_step(batch)
        t_train = time.monotonic() - t0 - t_wait
        version += 1
        sync_s = 0.0
        if version % tr.sync_every == 0:
            t1 = time.monotonic()
            transport.publish(version)
            sync_s = time.monotonic() - t1
        stats = ray.get(buffer.take_recent_stats.remote())
        cstat = ray.get(controller.status.remote())
        wstat = serving.weight_status()
        step_s = time.monotonic() - t0
        engine_idle = _engine_idle(wstat.get("engines", {}), last_engine)
        last_engine = wstat.get("engines", {})
        trained_tokens = sum(sum(s.mask) for s in batch.samples)
        row = {
            "step": step, "policy_version": version, "reward_mean": stats["reward_mean"],
            "pass_rate": stats["pass_rate"], "episodes": stats["episodes"],
            "loss": m.get("loss"), "grad_norm": m.get("grad_norm"), "entropy": m.get("entropy"),
            "trainer_step_s": m.get("step_time_s"),
            "kl": m.get("kl"), "clip_frac": m.get("clip_frac"),
            "tis_mismatch": m.get("mismatch_abs_mean", m.get("logp_mismatch_mean")),
            "staleness_mean": st_mean, "staleness_max": st_max, "staleness_hist": hist,
            "trainer_idle_frac": t_wait / step_s if step_s else 0.0,
            "engine_idle_frac": engine_idle,
            "gen_tokens_per_s": stats["generated_tokens"] / step_s if step_s else 0.0,
            "train_tokens_per_s": trained_tokens / t_train if t_train else 0.0,
            "sync_s": sync_s, "step_s": step_s, "wait_s": t_wait, "train_s": t_train,
            "samples": len(batch.samples),
            "in_flight_episodes": cstat["in_flight_episodes"],
            **{k: v for k, v in stats.items() if k.startswith("count/")},
            **{k: v for k, v in cstat.items() if k.startswith("count/")},
        }
        sink.log(row)
        out_of_time = deadline is not None and time.monotonic() >= deadline and step < tr.steps
        if out_of_time:
            print(f"rl360: time budget of {tr.max_minutes:g} min reached after step {step}")
        if ((tr.checkpoint_every and step % tr.checkpoint_every == 0) or step == tr.steps
                or STOP.requested or out_of_time):
            path = save_checkpoint(run_dir, step, version, trainer, buffer, cstat, tr.keep_checkpoints)
            if STOP.requested or out_of_time:
                print(f"rl360: stopped; checkpoint {path} (continue with --resume)")
                return


def _engine_idle(now: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]) -> float:
    fracs = []
    for rep, h in now.items():
        b = before.get(rep)
        if b is None or "busy_s" not in h or "uptime_s" not in h:
            continue
        dt = h["uptime_s"] - b["uptime_s"]
        if dt > 0:
            fracs.append(1.0 - min(1.0, (h["busy_s"] - b["busy_s"]) / dt))
    return sum(fracs) / len(fracs) if fracs else float("nan")


def save_checkpoint(run_dir: Path, step: int, version: int, trainer: Any, buffer: Any,
                    cstat: dict[str, Any], keep: int) -> Path:
    import ray

    root = run_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer.save(tmp / "model")
    (tmp / "buffer.msgpack").write_bytes(ray.get(buffer.state.remote()))
    meta = {"step": step, "version": version, "groups_started": cstat["groups_started"],
            "tasks_taken": cstat["tasks_taken"], "time": time.time()}
    (tmp / CKPT_META).write_text(json.dumps(meta, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)  # complete or absent: a kill mid-save leaves only a .tmp dir
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _print_curve(rows: list[dict[str, Any]]) -> None:
    pts = [(r["step"], r["reward_mean"]) for r in rows if isinstance(r.get("reward_mean"), int | float)]
    if not pts:
        return
    first, best, last = pts[0][1], max(p[1] for p in pts), pts[-1][1]
    print(f"reward: first step {first:.3f}, best {best:.3f}, last {last:.3f} over {len(pts)} steps")
    width = 50
    for s, v in pts[:: max(1, len(pts) // 20)]:
        print(f"  step {s:>4} {v:5.3f} {'#' * round(v * width)}")
