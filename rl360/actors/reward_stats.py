"""What a training step logs about its episodes: pure functions over EpisodeRecords.

The buffer hands a step the records of the batch it trained (its groups' episodes, plus those of
the groups that finished unqueued before the cut: filtered, all infra, stale); `episode_metrics`
turns them into flat metric keys, `group_metrics` counts the group outcomes, `with_deltas` adds
each domain's change since the first step that logged it.

Keys (all flat, one level of `/` per name part):
  reward_mean, pass_rate, infra_rate, episodes, tokens, loss_tokens     over every episode
  domain/<d>/{reward_mean,pass_rate,infra_rate,episodes,tokens,loss_tokens,reward_delta}
  task/<id>/{reward_mean,pass_rate,infra_rate,episodes,loss_tokens}
  component/<c>/mean (over the scored episodes that report component c)
  groups/{total,positive,negative,zero_variance,all_infra,filtered}
  masked/{infra,filtered,empty}  episodes that get no gradient, by why
  tito/{rerender_checked,rerender_mismatch_rate,<kind>,error}  the ledger's re-render check
Reward and pass figures are over scored episodes (infrastructure failures excluded); the infra
rate is over all of them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from rl360.types import RERENDER_KINDS, EpisodeRecord, Task

UNKNOWN_DOMAIN = "unknown"


def task_domain(task: Task) -> str:
    """A task's domain: its `domain` or `family` field (the loaders fill `domain` from the task
    file's directory name when neither is set), else "unknown"."""
    d = task.data.get("domain") or task.data.get("family")
    return str(d) if d else UNKNOWN_DOMAIN


def passed(record: EpisodeRecord) -> bool:
    """A scored episode passed: its `all_pass` component, else reward >= 1."""
    r = record.reward
    if r is None:
        return False
    return bool(r.components.get("all_pass", r.value >= 1.0))


def _key(part: str) -> str:
    return part.replace("/", "_") or UNKNOWN_DOMAIN


def _summary(records: list[EpisodeRecord]) -> dict[str, float]:
    scored = [r for r in records if r.valid]
    n = len(records)
    rewards = [r.reward.value for r in scored if r.reward is not None]
    return {
        "episodes": n,
        "reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
        "pass_rate": sum(passed(r) for r in scored) / len(scored) if scored else math.nan,
        "infra_rate": sum(r.status == "infra_error" for r in records) / n if n else math.nan,
        "tokens": sum(r.tokens for r in records),
        "loss_tokens": sum(r.loss_tokens for r in records),
    }


def episode_metrics(records: Iterable[EpisodeRecord], by_task: bool = True) -> dict[str, float]:
    """Overall, per-domain, per-task and per-component figures of `records`."""
    records = list(records)
    out: dict[str, float] = dict(_summary(records))
    by_domain: dict[str, list[EpisodeRecord]] = defaultdict(list)
    tasks: dict[str, list[EpisodeRecord]] = defaultdict(list)
    comps: dict[str, list[float]] = defaultdict(list)
    for r in records:
        by_domain[r.domain or UNKNOWN_DOMAIN].append(r)
        tasks[r.task_id].append(r)
        if r.valid and r.reward is not None:
            for c, v in r.reward.components.items():
                if isinstance(v, int | float):
                    comps[c].append(float(v))
    for d, rs in sorted(by_domain.items()):
        for k, v in _summary(rs).items():
            out[f"domain/{_key(d)}/{k}"] = v
    if by_task:
        for t, rs in sorted(tasks.items()):
            s = _summary(rs)
            for k in ("reward_mean", "pass_rate", "infra_rate", "episodes", "loss_tokens"):
                out[f"task/{_key(t)}/{k}"] = s[k]
    for c, vs in sorted(comps.items()):
        out[f"component/{_key(c)}/mean"] = sum(vs) / len(vs)
    return out


class TaskRewards:
    """Each task's latest mean reward, read back from the steps' `task/<id>/reward_mean` keys
    (`episode_metrics`): the driver's `task_reward_mean`, every task seen counted once."""

    def __init__(self) -> None:
        self.by_task: dict[str, float] = {}

    def update(self, stats: Mapping[str, Any]) -> None:
        for k, v in stats.items():
            if (k.startswith("task/") and k.endswith("/reward_mean")
                    and isinstance(v, int | float) and math.isfinite(v)):
                self.by_task[k[len("task/"):-len("/reward_mean")]] = float(v)

    def mean(self) -> float:
        return sum(self.by_task.values()) / len(self.by_task) if self.by_task else float("nan")


def group_outcome(records: list[EpisodeRecord]) -> dict[str, bool]:
    """How one finished group counts: positive (some scored episode passed), negative (none
    did), zero_variance (every scored reward equal: no learning signal), all_infra (nothing
    scored). positive/negative and zero_variance overlap (an all-pass group is both)."""
    scored = [r for r in records if r.valid and r.reward is not None]
    if not scored:
        return {"all_infra": True}
    rewards = [r.reward.value for r in scored if r.reward is not None]
    pos = any(passed(r) for r in scored)
    return {"positive": pos, "negative": not pos,
            "zero_variance": max(rewards) - min(rewards) < 1e-9}


def group_metrics(outcomes: Iterable[Mapping[str, bool]], filtered: int = 0) -> dict[str, int]:
    """Counts of group outcomes (`group_outcome`) and of groups the buffer filtered out."""
    out = {f"groups/{k}": 0 for k in ("total", "positive", "negative", "zero_variance", "all_infra")}
    for o in outcomes:
        out["groups/total"] += 1
        for k, v in o.items():
            out[f"groups/{k}"] += int(v)
    out["groups/filtered"] = filtered
    return out


def masked_metrics(records: Iterable[EpisodeRecord], filtered_episodes: int) -> dict[str, int]:
    """Episodes that get no gradient: infrastructure failures, those of filtered groups
    (zero variance), and scored ones with no tokens."""
    records = list(records)
    return {
        "masked/infra": sum(r.status == "infra_error" for r in records),
        "masked/filtered": filtered_episodes,
        "masked/empty": sum(r.valid and r.tokens == 0 for r in records),
    }


def with_deltas(row: dict[str, Any], first: dict[str, float]) -> dict[str, Any]:
    """`row` plus `domain/<d>/reward_delta` = its reward mean minus that domain's first logged
    one. `first` (domain key -> first value) is updated in place with domains seen first now."""
    out = dict(row)
    for k, v in row.items():
        if not (k.startswith("domain/") and k.endswith("/reward_mean")):
            continue
        if not isinstance(v, int | float) or math.isnan(v):
            continue
        base = first.setdefault(k, float(v))
        out[k[: -len("reward_mean")] + "reward_delta"] = float(v) - base
    return out


def first_values(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The first logged value of every domain reward mean in earlier rows (for a resume)."""
    first: dict[str, float] = {}
    for row in rows:
        for k, v in row.items():
            if (k.startswith("domain/") and k.endswith("/reward_mean")
                    and isinstance(v, int | float) and not math.isnan(v)):
                first.setdefault(k, float(v))
    return first


def tito_metrics(records: Iterable[EpisodeRecord]) -> dict[str, float]:
    """`tito/*`: the session ledger's re-render check (TITO invariant 7) over the samples of
    `records`: how many were checked, the share that did not match, and each kind of
    difference summed (special_token_count, special_token_type and non_assistant_text mean
    the ledger and the chat template disagree; assistant_text and eos_alias are expected
    with some templates). Nothing when no sample was checked."""
    sums: dict[str, int] = defaultdict(int)
    for r in records:
        for k, v in r.rerender.items():
            sums[k] += v
    if not sums.get("checked"):
        return {}
    out: dict[str, float] = {"tito/rerender_checked": sums["checked"],
                             "tito/rerender_mismatch_rate": sums["mismatch"] / sums["checked"]}
    for k in (*RERENDER_KINDS, "error"):
        out[f"tito/{k}"] = sums[k]
    return out


def timing_metrics(records: Iterable[EpisodeRecord]) -> dict[str, float]:
    """`time/episode/<phase>`: the mean seconds per episode of each phase the env actor timed
    (open, sandbox start, chat, the server's render / engine / commit share of it, tools,
    verify, cleanup, close, the whole episode), over the episodes that timed it."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for r in records:
        for k, v in r.timings.items():
            if isinstance(v, int | float) and math.isfinite(v):
                sums[k] += float(v)
                counts[k] += 1
    return {f"time/episode/{_key(k)}": sums[k] / counts[k] for k in sorted(sums)}
