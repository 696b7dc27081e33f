"""The row a training step writes to metrics.jsonl (and wandb, Ray gauges, the progress line):
`StepRow`, typed, and the engine figures it takes from the replicas' health reports.

Fields are the row's keys; a key with a slash is named by `msgspec.field(name=...)`. A field
left UNSET (a figure the step does not have: no weight sync this step, a loss option off) is
not written. The families whose keys depend on the run (per domain, task and component, the
counters, the held-out evaluation, the start-up marks) travel in `families` and are written
beside the fields.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType, field

Opt = float | None  # a trainer figure the backend may not report (None is written)


class StepRow(msgspec.Struct, kw_only=True):
    step: int
    policy_version: int
    reward_mean: Opt
    pass_rate: Opt
    episodes: int
    # every task seen so far counted once, at its latest group's mean reward (a parked task at
    # its last one): the batch's task mix does not move it
    task_reward_mean: float
    tasks_seen: int
    tasks_parked: int
    # the episodes finished since the previous step (the step's own figures are those of the
    # batch it trained: TrajectoryBuffer.take_recent_stats)
    episodes_finished: int
    loss: Opt
    grad_norm: Opt
    entropy: Opt
    trainer_step_s: Opt
    kl: Opt
    clip_frac: Opt
    tis_mismatch: Opt
    staleness_mean: float
    staleness_max: float
    staleness_hist: dict[str, int]
    trainer_idle_frac: float
    engine_idle_frac: float
    # torch engine: requests whose prompt another request of the same admission had (a
    # group's members): prefilled once, K/V copied
    engine_prefills_shared: float
    # torch engine, in-flight updates: the longest token gap of a running sequence across a
    # weight swap so far, and the swap / decode step it compares with (engine_maxima)
    engine_sync_pause_max_s: float | UnsetType = UNSET
    engine_sync_pause_excess_max_s: float | UnsetType = UNSET
    engine_sync_pause_over_budget_max_s: float | UnsetType = UNSET
    engine_last_swap_s: float | UnsetType = UNSET
    engine_step_median_s: float | UnsetType = UNSET
    engine_step_change_max_s: float | UnsetType = UNSET
    engine_step_change_p95_s: float | UnsetType = UNSET
    engine_sync_over_median_s: float | UnsetType = UNSET
    engine_sync_over_max_s: float | UnsetType = UNSET
    gen_tokens_per_s: float
    train_tokens_per_s: float
    sync_s: float
    step_s: float
    wait_s: float
    train_s: float
    # object store: the sender's write of the last version, and whether it went through a
    # weight slot (1) or a fresh object-store object (0); set on steps that synced
    sync_put_s: float | UnsetType = UNSET
    sync_slot: float | UnsetType = UNSET
    # sharded collective: the epoch of membership the version went out in, the replicas that
    # took it, and the largest peak of a trainer rank's resident memory above where it
    # started during its send (MB; unset where /proc does not allow measuring it)
    sync_epoch: float | UnsetType = UNSET
    sync_replicas: float | UnsetType = UNSET
    sync_rank_peak_mb: float | UnsetType = UNSET
    # seconds since this process started the run (Ray, Serve, actors, steps): the x axis of
    # `rl360 plot --x time`; a --resume starts it again from 0
    elapsed_s: float
    # where the step's wall time went (the env actors' per-episode phases come from the buffer
    # as time/episode/*; bench/step_breakdown.py adds CPU time)
    time_rollout_wait_s: float = field(name="time/rollout_wait_s")
    time_train_s: float = field(name="time/train_s")
    time_sync_s: float = field(name="time/sync_s")
    time_bookkeeping_s: float = field(name="time/bookkeeping_s")
    # of which: the trajectory log + eval start, and the buffer / controller / publisher
    # status calls (each waits for its actor's loop)
    time_log_s: float = field(name="time/log_s")
    time_status_s: float = field(name="time/status_s")
    time_engine_busy_s: float = field(name="time/engine_busy_s")
    samples: int
    is_ess_frac: Opt
    sampler_kl: Opt
    tis_capped_frac: Opt
    # trainer.loss.seq_mask: the share of loss tokens in masked sequences, and
    # trainer.loss.behaviour_clip: the share of loss tokens it zeroed
    seq_masked_frac: float | UnsetType = UNSET
    seq_log_ratio_abs_max: float | UnsetType = UNSET
    behaviour_clip_frac: float | UnsetType = UNSET
    optimizer_steps: Opt
    in_flight_episodes: int
    infra_rate: Opt
    tokens: float | None
    # per domain / task / component, group outcomes, masked counts (reward_stats), count/*,
    # eval/* and, on a process's first step, startup/*: written as they are
    families: dict[str, Any] = {}

    def metrics(self) -> dict[str, Any]:
        """The row as metrics.jsonl has it: one flat mapping."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        out.update(out.pop("families"))
        return out


# the engines' health figures the row carries as their largest value over the replicas
ENGINE_MAXIMA = ("sync_pause_max_s", "sync_pause_excess_max_s", "sync_pause_over_budget_max_s",
                 "last_swap_s", "step_median_s", "step_change_max_s", "step_change_p95_s",
                 "sync_over_median_s", "sync_over_max_s")
# the trainer figures written only when the trainer reports them
TRAINER_OPTIONAL = ("seq_masked_frac", "seq_log_ratio_abs_max", "behaviour_clip_frac")


def engine_maxima(engines: dict[str, dict[str, Any]]) -> dict[str, float]:
    """`engine_<key>`: the largest value over the replicas that report `key`."""
    out = {}
    for k in ENGINE_MAXIMA:
        vals = [h[k] for h in engines.values()
                if isinstance(h.get(k), int | float) and math.isfinite(h[k])]
        if vals:
            out[f"engine_{k}"] = float(max(vals))
    return out


def sync_detail(last: dict[str, Any]) -> dict[str, float]:
    """The object-store sender's figures of the version it just sent, or the sharded
    collective's (none for others)."""
    if last.get("kind") == "sharded":
        peak = last.get("rank_peak_extra_bytes")
        return {"sync_epoch": float(last["epoch"]), "sync_replicas": float(last["replicas"]),
                **({"sync_rank_peak_mb": peak / 1e6} if peak is not None else {})}
    if "put_s" not in last:
        return {}
    return {"sync_put_s": float(last["put_s"]), "sync_slot": 1.0 if last.get("slot") else 0.0}


def engine_idle(now: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]) -> float:
    """The mean share of the time since the last step the replicas spent outside model steps."""
    fracs = []
    for rep, h in now.items():
        b = before.get(rep)
        if b is None or "busy_s" not in h or "uptime_s" not in h:
            continue
        dt = h["uptime_s"] - b["uptime_s"]
        if dt > 0:
            fracs.append(1.0 - min(1.0, (h["busy_s"] - b["busy_s"]) / dt))
    return sum(fracs) / len(fracs) if fracs else float("nan")


def engine_delta(now: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]], key: str,
                 total: bool = False) -> float:
    """How much an engine counter (`busy_s`: seconds in model steps) grew since the last step:
    the mean per replica, or with `total` the sum over them."""
    grew = [h[key] - before[rep][key] for rep, h in now.items()
            if rep in before and key in h and key in before[rep]]
    if not grew:
        return float("nan")
    return sum(grew) if total else sum(grew) / len(grew)
