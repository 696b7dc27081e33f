"""`rl360 train`: the fully asynchronous RL loop of DESIGN.md, end to end.

engines + session server (Serve) <- env actors <- rollout controller -> trajectory buffer
-> trainer group -> weights published to every engine replica, while rollouts continue up to
`train.max_staleness` versions behind (0: synchronous on-policy).

Checkpoints (every `train.checkpoints.every` steps and at the end) hold the policy as HF
safetensors, the optimizer/step/RNG state, the buffer's queued groups and the controller's
position in the task stream; `--resume` continues from the newest one, so a run killed with
`kill -9` loses only the episodes that were in flight and the steps after that checkpoint.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import ray

from rl360.actors.buffer import TrajectoryBuffer
from rl360.actors.controller import ControllerFailed, RolloutController
from rl360.actors.metrics import MetricsSink, parked_run
from rl360.actors.reward_stats import TaskRewards, first_values, with_deltas
from rl360.actors.run_ledger import RunLedger
from rl360.actors.trainer_group import STALENESS_PREFIX, TrainerGroup
from rl360.envs.task_check import check_tasks
from rl360.launch.faults import faults_after, faults_before_sync, inject
from rl360.launch.roles import Placement
from rl360.launch.stack import Stack, running_stack
from rl360.launch.startup import StartupClock
from rl360.launch.step_log import TrainEval, TrajectoryLog, load_eval_tasks
from rl360.launch.step_row import (
    TRAINER_OPTIONAL,
    StepRow,
    engine_delta,
    engine_idle,
    engine_maxima,
    sync_detail,
)
from rl360.launch.support import support_problems
from rl360.launch.warm_start import WarmStartError, ensure_warm_start
from rl360.policies.loading import resolve_model_path
from rl360.ray_session import STOP
from rl360.recipe import CollectiveSync, Recipe
from rl360.types import Task
from rl360.weights.sender_calls import sender_env
from rl360.weights.shard_transport import WeightSyncFailed
from rl360.weights.transports import WeightTransport, build_transport

CKPT_META = "rl360_checkpoint.json"


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = sorted(p.parent for p in (run_dir / "checkpoints").glob(f"step_*/{CKPT_META}"))
    return done[-1] if done else None


def staleness_stats(metrics: dict[str, float]) -> tuple[dict[str, int], float, float]:
    """(loss tokens by staleness, mean, max) from the trainer ranks' summed histogram."""
    hist = {int(k[len(STALENESS_PREFIX):]): int(v) for k, v in metrics.items()
            if k.startswith(STALENESS_PREFIX)}
    n = sum(hist.values())
    mean = sum(k * c for k, c in hist.items()) / n if n else 0.0
    return {str(k): c for k, c in sorted(hist.items())}, mean, float(max(hist) if hist else 0)


@dataclass
class TrainActors:
    trainer: Any  # actors.trainer_group.TrainerGroup
    buffer: Any  # ActorHandle[TrajectoryBuffer]
    controller: Any  # ActorHandle[RolloutController]


def start_learners(recipe: Recipe, placement: Placement, model_path: Any) -> tuple[Any, Any]:
    """The trainer ranks (on the placement's train options) and the trajectory buffer (service
    role): what needs neither Serve nor the env actors, so it starts while they do
    (`running_stack`'s `early`)."""
    tr, t = recipe.train, recipe.trainer
    buffer = ray.remote(TrajectoryBuffer).options(
        name="rl360-trajectory-buffer", **placement.service_options()).remote(tr, t.advantage)
    sync = tr.weight_sync
    trainer = TrainerGroup(t, model_path, temperature=tr.sampling.temperature or 1.0,
                           seed=recipe.run.seed,
                           rank_options=trainer_rank_options(recipe, placement),
                           sharded_sync=isinstance(sync, CollectiveSync) and sync.sharded)
    return trainer, buffer


def trainer_rank_options(recipe: Recipe, placement: Placement) -> Callable[[int], dict[str, Any]]:
    """Each trainer rank's Ray options: the placement's, and for rank 0, the weight sender,
    the environment its sending wants (rl360.weights.sender.sender_env)."""
    env = sender_env(recipe.train.weight_sync)

    def options(rank: int) -> dict[str, Any]:
        out = dict(placement.trainer_options(rank))
        if rank == 0 and env:
            runtime_env = dict(out.get("runtime_env") or {})
            runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **env}
            out["runtime_env"] = runtime_env
        return out

    return options


def start_train_actors(recipe: Recipe, stack: Stack[Any], model_path: Any) -> TrainActors:
    """The trainer ranks and the buffer (`stack.early` when `start_learners` ran there) and the
    rollout controller (service role), wired to the stack's env actors and publisher."""
    if stack.pool is None:
        raise ValueError("start_train_actors needs a stack with env actors")
    trainer, buffer = stack.early or start_learners(recipe, stack.placement, model_path)
    controller = ray.remote(RolloutController).options(
        name="rl360-rollout-controller", max_concurrency=1000,
        **stack.placement.service_options()).remote(
            recipe.train, recipe.engine.replicas, stack.pool.actors, buffer,
            stack.serving.publisher, seed=recipe.run.seed)
    ray.get([buffer.size.remote(), controller.status.remote()])  # up, or raise here
    return TrainActors(trainer=trainer, buffer=buffer, controller=controller)


def train_command(recipe: Recipe, args: argparse.Namespace) -> int:
    """`rl360 train recipe.toml [--resume]`."""
    return run_train(recipe, resume=args.resume)


def run_train(recipe: Recipe, resume: bool = False) -> int:
    if problems := support_problems(recipe):
        for p in problems:
            print(f"rl360 train: {p}", file=sys.stderr)
        return 2
    try:  # tasks no env actor could set up fail here, before the warm start and Ray
        check_tasks(recipe.train.tasks, recipe.env, recipe.train.task_limit)
    except ValueError as exc:
        print(f"rl360 train: {exc}", file=sys.stderr)
        return 2
    try:
        run = TrainRun(recipe, resume)
        run.warm_start()
    except (TrainSetupError, WarmStartError) as exc:
        print(f"rl360: {exc}", file=sys.stderr)
        return 2
    return run.run()


class TrainSetupError(RuntimeError):
    """The run directory cannot be used as asked (checkpoints of another run, ...)."""


class TrainRun:
    """One `rl360 train`: its run directory and checkpoint, the warm start, the running stack
    and actors, the step loop, checkpoints and the progress it prints."""

    def __init__(self, recipe: Recipe, resume: bool = False) -> None:
        self.recipe = recipe
        self.run_dir = Path(recipe.run.out_dir) / recipe.run.name
        self.ckpt = latest_checkpoint(self.run_dir) if resume else None
        if resume and self.ckpt is None:
            print(f"rl360: --resume: no checkpoint under {self.run_dir / 'checkpoints'}; "
                  "starting fresh", file=sys.stderr)
        if not resume and (self.run_dir / "checkpoints").exists():
            raise TrainSetupError(f"{self.run_dir} has checkpoints from an earlier run; use "
                                  "--resume to continue or another run.name")
        self.meta: dict[str, Any] = (json.loads((self.ckpt / CKPT_META).read_text())
                                     if self.ckpt else {})
        self.step0 = int(self.meta.get("step", 0))
        self.version = int(self.meta.get("version", 0))
        self.deadline: float | None = None
        self.t_start = time.monotonic()  # reset when the run starts; `elapsed_s` counts from it
        self.sink: MetricsSink | None = None
        self.first_domain: dict[str, float] = {}  # domain reward at its first step (deltas)
        try:  # the held-out set of train.eval_every, checked before anything starts
            self.eval_tasks = load_eval_tasks(recipe.eval.tasks, recipe.eval.limit,
                                              recipe.train.eval_every)
        except ValueError as exc:
            raise TrainSetupError(str(exc)) from None
        self.traj_log: TrajectoryLog | None = None
        self.evaluator: TrainEval | None = None
        self.ledger: RunLedger | None = None

    # ------------------------------------------------------------------ set-up

    def warm_start(self) -> None:
        """The policy RL starts from (made by `rl360 sft` first when it is missing or stale);
        the engines and the trainer start from it."""
        self.recipe.model.path = ensure_warm_start(self.recipe, resuming=self.ckpt is not None)

    def run(self) -> int:
        recipe, tr = self.recipe, self.recipe.train
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # the time budget counts from here: Ray, Serve, the actors and every step (a warm
        # start is a one-time cost, cached for later runs)
        self.t_start = time.monotonic()
        self.deadline = self.t_start + tr.max_minutes * 60 if tr.max_minutes else None
        model_path = resolve_model_path(recipe.model.path)
        (self.run_dir / "recipe.json").write_text(json.dumps(msgspec.to_builtins(recipe), indent=2))
        self.ledger = RunLedger(self.run_dir, self.step0 if self.ckpt else None)
        policy = self.ckpt / "model" if self.ckpt else model_path
        clock = StartupClock(self.t_start)
        # a fresh run starts its rollout once the Serve app is deployed, while the engines load
        # (the first groups wait at the engine handle); a resumed one first loads its buffer and
        # publishes its weights, which needs the engines up
        early_rollout: list[TrainActors] = []

        def deployed(stack: Stack) -> None:
            early_rollout.append(start_train_actors(recipe, stack, policy))
            clock.mark("controller")
            self.start_controller(early_rollout[0])

        with running_stack(recipe, sampling=msgspec.to_builtins(tr.sampling),
                           early=lambda placement: start_learners(recipe, placement, policy),
                           deployed=None if self.ckpt else deployed, clock=clock) as stack:
            if early_rollout:
                actors = early_rollout[0]
            else:
                actors = start_train_actors(recipe, stack, policy)
                clock.mark("controller")
            print(f"rl360: up: {clock.line()}", file=sys.stderr)
            transport = build_transport(tr.weight_sync, stack.serving, actors.trainer,
                                        recipe.engine.replicas, dtype=recipe.model.dtype,
                                        inplace=recipe.engine.backend == "torch", say=_say)
            try:
                if self.ckpt is not None:
                    ray.get(actors.buffer.load_state.remote(
                        (self.ckpt / "buffer.msgpack").read_bytes()))
                    # the trainer was built from the checkpoint's weights (or adapter); its
                    # optimizer, scheduler, step and RNG state come back too
                    actors.trainer.load(self.ckpt / "model")
                    transport.publish(self.version)
                    print(f"rl360: resumed from {self.ckpt} (step {self.step0}, policy version "
                          f"{self.version})", file=sys.stderr)
                if not early_rollout:
                    self.start_controller(actors)
                # the metrics sink (wandb's import and init: ~2 s on 2 cores) is built while the
                # first batch generates: nothing before the first step needs it
                self.start_logs(stack, model_path)
                self.loop(stack, actors, transport)
                self._last_eval()
            except ray.exceptions.RayTaskError as exc:
                if not isinstance(exc.cause, ControllerFailed):
                    raise
                print(f"rl360: {exc.cause}", file=sys.stderr)
                return 1
            except WeightSyncFailed as exc:  # the fault rules said stop: one line, and where
                ckpt = latest_checkpoint(self.run_dir)
                where = (f"continue from {ckpt} with --resume" if ckpt else
                         "no checkpoint yet: start again")
                print(f"rl360: {exc}; {where}", file=sys.stderr)
                return 1
            except ray.exceptions.RayActorError as exc:
                # the controller, the buffer or a trainer rank died: their state does not
                # survive a restart, so the run ends here and resumes from its newest checkpoint
                ckpt = latest_checkpoint(self.run_dir)
                where = (f"continue from {ckpt} with --resume" if ckpt else
                         "no checkpoint yet: start again")
                why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
                print(f"rl360: a part of the run died ({type(exc).__name__}: {why}); {where}",
                      file=sys.stderr)
                return 1
            finally:
                try:
                    ray.get(actors.controller.stop.remote(), timeout=30)
                except Exception as exc:
                    print(f"rl360: controller stop: {exc!r}", file=sys.stderr)
                png = self.sink.close() if self.sink is not None else None
                actors.trainer.shutdown()  # env actors, Serve app, placement groups: running_stack
                if png:
                    print(f"rl360: reward curve -> {png}")
        if self.sink is not None:
            _print_curve(self.sink.rows)
        return 0

    def start_controller(self, actors: TrainActors) -> None:
        """The rollout controller's loop, from the checkpoint's stream position when resuming."""
        pending = msgspec.convert(self.meta.get("pending_tasks", []), list[Task])
        ray.get(actors.controller.start.remote(int(self.meta.get("groups_started", 0)),
                                               int(self.meta.get("tasks_taken", 0)),
                                               pending, self.meta.get("pending_occ"),
                                               int(self.meta.get("seq", 0)),
                                               self.meta.get("parking")))

    def start_logs(self, stack: Stack, model_path: Path) -> None:
        """The metrics sink (wandb), the trajectory log and the periodic evaluation."""
        recipe, tr = self.recipe, self.recipe.train
        self.sink = MetricsSink(self.run_dir, recipe.run.name, tr.steps, tr.wandb,
                                msgspec.to_builtins(recipe), resume=self.ckpt is not None)
        self.first_domain = first_values(self.sink.rows)
        self.traj_log = TrajectoryLog(self.run_dir / "trajectories.jsonl",
                                      tr.log_trajectories, str(model_path), recipe.run.seed)
        assert stack.pool is not None
        self.evaluator = TrainEval(tr.eval_every, self.eval_tasks, stack.pool.actors,
                                   msgspec.to_builtins(recipe.eval.sampling))

    # ------------------------------------------------------------------ the step loop

    def loop(self, stack: Stack, actors: TrainActors, transport: WeightTransport) -> None:
        tr = self.recipe.train
        last_engine: dict[str, dict[str, Any]] = {}
        # this process's start-up marks (docs/step-metrics.md: startup/*), on its first step's row
        startup = stack.clock.as_metrics() if stack.clock is not None else {}
        latest = TaskRewards()
        for step in range(self.step0 + 1, tr.steps + 1):
            t0 = time.monotonic()
            batch = self._next_batch(actors, step, transport)
            if batch is None:  # Ctrl-C / SIGTERM, or the time budget ran out while waiting
                if not STOP.requested:
                    print(f"rl360: time budget of {tr.max_minutes:g} min reached while waiting "
                          f"for the batch of step {step}")
                if step > self.step0 + 1:
                    path = self.checkpoint(step - 1, actors)
                    print(f"rl360: stopped; checkpoint {path} (continue with --resume)")
                return
            t_wait = time.monotonic() - t0
            m = actors.trainer.train_step(batch)
            hist, st_mean, st_max = staleness_stats(m)
            t_train = time.monotonic() - t0 - t_wait
            self.version += 1
            sync_s = 0.0
            for part in faults_before_sync(tr.inject_faults, step):  # drills: a hung part
                self._fault(step, part, stack, "before the weight sync of step")
            if self.version % tr.sync_every == 0:
                t1 = time.monotonic()
                transport.publish(self.version)
                sync_s = time.monotonic() - t1
            assert self.traj_log is not None and self.evaluator is not None
            t_log0 = time.monotonic()
            self.traj_log.write(batch, step)
            self.evaluator.maybe_start(step)  # on the policy just published; never waited for
            t_status0 = time.monotonic()
            stats = ray.get(actors.buffer.take_recent_stats.remote())
            cstat = ray.get(actors.controller.status.remote())
            wstat = stack.serving.weight_status()
            step_s = time.monotonic() - t0
            t_status = time.monotonic() - t_status0
            latest.update(stats)
            engines = wstat.get("engines", {})
            idle = engine_idle(engines, last_engine)
            busy = engine_delta(engines, last_engine, "busy_s")
            shared = engine_delta(engines, last_engine, "prefills_shared", total=True)
            last_engine = engines
            families = {
                **{k: v for k, v in stats.items() if k.startswith("count/")},
                **{k: v for k, v in cstat.items() if k.startswith("count/")},
                **{k: v for k, v in stats.items() if "/" in k and not k.startswith("count/")},
                **self.evaluator.poll(),
                **(startup if step == self.step0 + 1 else {}),
            }
            row = StepRow(
                step=step, policy_version=self.version, reward_mean=stats["reward_mean"],
                pass_rate=stats["pass_rate"], episodes=stats["episodes"],
                task_reward_mean=latest.mean(), tasks_seen=len(latest.by_task),
                tasks_parked=cstat.get("tasks_parked", 0),
                episodes_finished=stats["episodes_finished"],
                loss=m.get("loss"), grad_norm=m.get("grad_norm"), entropy=m.get("entropy"),
                trainer_step_s=m.get("step_time_s"), kl=m.get("kl"), clip_frac=m.get("clip_frac"),
                tis_mismatch=m.get("mismatch_abs_mean", m.get("logp_mismatch_mean")),
                staleness_mean=st_mean, staleness_max=st_max, staleness_hist=hist,
                trainer_idle_frac=t_wait / step_s if step_s else 0.0,
                engine_idle_frac=idle, engine_prefills_shared=shared,
                **engine_maxima(engines),
                gen_tokens_per_s=stats["generated_tokens"] / step_s if step_s else 0.0,
                train_tokens_per_s=batch.loss_tokens / t_train if t_train else 0.0,
                sync_s=sync_s, step_s=step_s, wait_s=t_wait, train_s=t_train,
                **sync_detail(getattr(transport, "last", {}) if sync_s else {}),
                elapsed_s=time.monotonic() - self.t_start,
                time_rollout_wait_s=t_wait, time_train_s=t_train, time_sync_s=sync_s,
                time_bookkeeping_s=step_s - t_wait - t_train - sync_s,
                time_log_s=t_status0 - t_log0, time_status_s=t_status,
                time_engine_busy_s=busy,
                samples=len(batch.members), is_ess_frac=m.get("is_ess_frac"),
                sampler_kl=m.get("sampler_kl"), tis_capped_frac=m.get("tis_capped_frac"),
                **{k: m[k] for k in TRAINER_OPTIONAL if k in m},
                optimizer_steps=m.get("optimizer_steps"),
                in_flight_episodes=cstat["in_flight_episodes"],
                infra_rate=stats.get("infra_rate"), tokens=stats.get("tokens"),
                families=families)
            assert self.sink is not None
            self.sink.log(with_deltas(row.metrics(), self.first_domain))
            out_of_time = (self.deadline is not None and time.monotonic() >= self.deadline
                           and step < tr.steps)
            if out_of_time:
                print(f"rl360: time budget of {tr.max_minutes:g} min reached after step {step}")
            assert self.ledger is not None
            self.ledger.write(step, "step", ray.get(actors.controller.take_events.remote()),
                              t=time.time(), trained=sorted({m.group_id for m in batch.members}))
            if ((tr.checkpoints.every and step % tr.checkpoints.every == 0) or step == tr.steps
                    or STOP.requested or out_of_time):
                path = self.checkpoint(step, actors)
                if STOP.requested or out_of_time:
                    print(f"rl360: stopped; checkpoint {path} (continue with --resume)")
                    return
            for part in faults_after(tr.inject_faults, step):  # drills: kill a part now
                self._fault(step, part, stack, "after step")

    def _fault(self, step: int, part: str, stack: Stack, when: str) -> None:
        """A fault drill: kill (or stall) `part` now; a `fault` row in the ledger."""
        assert self.ledger is not None
        killed = inject(part, stack)
        self.ledger.write(step, "fault", part=part, killed=killed, t=time.time())
        what = "stalled" if part == "engine_stall" else "killed"
        print(f"rl360: fault drill: {what} {killed} ({part}) {when} {step}", file=sys.stderr,
              flush=True)

    def _last_eval(self, timeout_s: float = 300.0) -> None:
        """The evaluation still running when the last step is done: waited for (bounded) and
        logged against that step."""
        if STOP.requested or self.evaluator is None or self.sink is None:
            return
        if self.evaluator.pending and self.sink.rows:
            out_of_time = self.deadline is not None and time.monotonic() >= self.deadline
            if ev := self.evaluator.poll(0.0 if out_of_time else timeout_s):
                self.sink.log({"step": self.sink.rows[-1]["step"], **ev})

    def _next_batch(self, actors: TrainActors, step: int,
                    transport: WeightTransport | None = None) -> Any:
        """The batch of `step` from the buffer; None once a stop was requested or the time
        budget is spent. A failed controller (its circuit breaker, say) raises here. While it
        waits (the trainer idle), a transport that heals gives replicas that (re)started the
        newest weights (rl360.weights.shard_transport)."""
        heal = getattr(transport, "heal", None)
        while not STOP.requested and (self.deadline is None or time.monotonic() < self.deadline):
            batch = ray.get(actors.buffer.next_batch.remote(self.version, step, 2.0))
            if batch is not None:
                return batch
            ray.get(actors.controller.status.remote())  # surface a dead controller
            if heal is not None:
                heal(self.version)
        return None

    def checkpoint(self, step: int, actors: TrainActors) -> Path:
        return save_checkpoint(self.run_dir, step, self.version, actors.trainer,
                               actors.controller, self.recipe.train.checkpoints.keep, self.ledger)


def save_checkpoint(run_dir: Path, step: int, version: int, trainer: Any, controller: Any,
                    keep: int, ledger: RunLedger | None = None) -> Path:
    """model + optimizer state, the buffer's queued groups (their trajectories whole) and the
    controller's resume state, written to a temp dir and renamed: complete or absent. The
    ledger's checkpoint row is written before the rename: a resume from an older checkpoint
    drops it with every row after that checkpoint."""
    root = run_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer.save(tmp / "model")
    blob, resume = ray.get(controller.checkpoint_state.remote())
    events = resume.pop("ledger", [])
    (tmp / "buffer.msgpack").write_bytes(blob)
    meta = {"step": step, "version": version, **resume, "time": time.time()}
    (tmp / CKPT_META).write_text(json.dumps(meta, indent=2))
    if ledger is not None:
        ledger.write(step, "checkpoint", events, tasks_taken=resume["tasks_taken"],
                     pending_occ=resume["pending_occ"])
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)  # complete or absent: a kill mid-save leaves only a .tmp dir
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _print_curve(rows: list[dict[str, Any]]) -> None:
    # once tasks were parked the batch's mix moved: the all-task reward tells the run
    key = "task_reward_mean" if parked_run(rows) else "reward_mean"
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
    if not pts:
        return
    first, best, last = pts[0][1], max(p[1] for p in pts), pts[-1][1]
    what = "all-task reward" if key == "task_reward_mean" else "reward"
    print(f"{what}: first step {first:.3f}, best {best:.3f}, last {last:.3f} over {len(pts)} steps")
    width = 50
    for s, v in pts[:: max(1, len(pts) // 20)]:
        print(f"  step {s:>4} {v:5.3f} {'#' * round(v * width)}")


def _say(line: str) -> None:
    """A weight sync's one-line report (a replica that failed, what the run does about it)."""
    print(f"rl360: {line}", file=sys.stderr, flush=True)
