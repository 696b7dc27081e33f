"""What `rl360 eval` reports beside its per-task table, the way a paper would: per family
(the task's domain) pass@1, mean reward, tool calls parsed, turns per episode, each with a
bootstrap 95% confidence interval over *instances* (an instance's attempts stay together, so
k attempts of one task do not count as k independent samples); and the comparison of two
evals of the same tasks (before / after training) with the paired bootstrap of the difference.

Infra failures are left out of every score (they are counted beside them), as in the table.
"""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from rl360.types import Trajectory

BOOTSTRAP_RESAMPLES = 2000
# what looks like a tool call in a reply: the call tags, or a call-shaped JSON object
_CALL_HINT = re.compile(r'<tool_call|</tool_call>|\{\s*"name"\s*:\s*"[^"]*"\s*,\s*"(arguments|parameters)"')


def passed(t: Trajectory) -> bool:
    if t.reward is None:
        return False
    return bool(t.reward.components.get("all_pass", float(t.reward.value >= 1.0 - 1e-9)))


def bootstrap_ci(groups: Sequence[Sequence[float]], stat: Callable[[list[float]], float] | None = None,
                 resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float, float]:
    """(estimate, low, high): the mean of every value (or `stat` of them), and its percentile
    interval when the groups (an instance's attempts) are resampled with replacement."""
    stat = stat or (lambda xs: sum(xs) / len(xs))
    groups = [list(g) for g in groups if len(g)]
    if not groups:
        return float("nan"), float("nan"), float("nan")
    est = stat([x for g in groups for x in g])
    rng = random.Random(seed)
    n = len(groups)
    draws = []
    for _ in range(resamples):
        pick = [groups[rng.randrange(n)] for _ in range(n)]
        draws.append(stat([x for g in pick for x in g]))
    draws.sort()
    lo = draws[int((1 - level) / 2 * resamples)]
    hi = draws[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return est, lo, hi


def generated_turns(t: Trajectory) -> int:
    """Assistant turns of the episode: the runs of generated tokens in its ledger."""
    runs, prev = 0, 0
    for m in t.mask:
        if m and not prev:
            runs += 1
        prev = m
    return runs


def call_accounting(texts: Sequence[str], parse: Callable[[str], Any]) -> dict[str, Any]:
    """How the tool calls a model wrote were taken: parsed, malformed (with the reasons), and
    attempts the parser did not see at all (text that looks like a call outside any tag the
    parser reads). `parse` is ChatRenderer.parse_assistant."""
    parsed = malformed = unseen = 0
    reasons: dict[str, int] = defaultdict(int)
    for text in texts:
        p = parse(text)
        parsed += len(p.tool_calls)
        malformed += p.malformed_tool_calls
        for r in p.malformed_reasons:
            reasons[re.sub(r"\(.*\)", "(...)", r)] += 1
        # what is left as content once the parsed spans are gone and no malformed call was
        # counted, yet still looks like a call, is an attempt the parser missed
        if not p.malformed_tool_calls and _CALL_HINT.search(p.content or ""):
            unseen += 1
    written = parsed + malformed + unseen
    return {"written": written, "parsed": parsed, "malformed": malformed, "unseen": unseen,
            "accounted": (parsed + malformed) / written if written else 1.0,
            "reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1]))}


def family_report(trajs: Sequence[Trajectory], seed: int = 0) -> dict[str, Any]:
    """Per family and overall: pass@1, mean reward, turns, tool calls (each with its 95% CI
    over instances), episodes and infra failures."""
    by_family: dict[str, dict[str, list[Trajectory]]] = defaultdict(lambda: defaultdict(list))
    for t in trajs:
        by_family[t.domain or "?"][t.task_id or "?"].append(t)
    by_family["all"] = defaultdict(list)
    for t in trajs:
        by_family["all"][t.task_id or "?"].append(t)
    out: dict[str, Any] = {}
    for fam, tasks in sorted(by_family.items(), key=lambda kv: (kv[0] == "all", kv[0])):
        scored = {k: [t for t in ts if t.status != "infra_error" and t.reward is not None]
                  for k, ts in tasks.items()}
        groups = [g for g in scored.values() if g]
        n_eps = sum(len(ts) for ts in tasks.values())
        row: dict[str, Any] = {"instances": len(groups), "episodes": sum(map(len, groups)),
                               "infra_errors": n_eps - sum(map(len, groups))}
        metrics = {
            "pass@1": lambda t: float(passed(t)),
            "mean_reward": lambda t: float(t.reward.value),  # type: ignore[union-attr]
            "turns": lambda t: float(generated_turns(t)),
            "tool_calls": lambda t: float(t.counters.get("tool_calls", 0)),
            "called_a_tool": lambda t: float(t.counters.get("tool_calls", 0) > 0),
        }
        for name, f in metrics.items():
            est, lo, hi = bootstrap_ci([[f(t) for t in g] for g in groups], seed=seed)
            row[name] = {"value": est, "ci95": [lo, hi]}
        calls = sum(t.counters.get("tool_calls", 0) for g in groups for t in g)
        bad = sum(t.counters.get("malformed_tool_calls", 0) for g in groups for t in g)
        row["tool_call_parse_rate"] = calls / (calls + bad) if calls + bad else float("nan")
        out[fam] = row
    return out


def compare(before: Sequence[Trajectory], after: Sequence[Trajectory], seed: int = 0,
            resamples: int = BOOTSTRAP_RESAMPLES) -> dict[str, Any]:
    """pass@1 before and after on the tasks both evals scored, per family and overall: each
    side's 95% CI, the difference with its paired bootstrap CI, and whether the two CIs
    overlap."""
    def per_task(trajs: Sequence[Trajectory]) -> dict[str, list[float]]:
        d: dict[str, list[float]] = defaultdict(list)
        for t in trajs:
            if t.status != "infra_error" and t.reward is not None:
                d[t.task_id or "?"].append(float(passed(t)))
        return d

    b, a = per_task(before), per_task(after)
    fam_of = {t.task_id: t.domain for t in [*before, *after]}
    common = sorted(set(b) & set(a))
    families = [*sorted({fam_of[k] or "?" for k in common}), "all"]
    out: dict[str, Any] = {}
    for fam in families:
        keys = [k for k in common if fam == "all" or fam_of[k] == fam]
        if not keys:
            continue
        eb, lb, hb = bootstrap_ci([b[k] for k in keys], seed=seed, resamples=resamples)
        ea, la, ha = bootstrap_ci([a[k] for k in keys], seed=seed + 1, resamples=resamples)
        rng = random.Random(seed + 2)
        diffs = []
        for _ in range(resamples):
            pick = [keys[rng.randrange(len(keys))] for _ in keys]
            diffs.append(sum(sum(a[k]) / len(a[k]) for k in pick) / len(pick)
                         - sum(sum(b[k]) / len(b[k]) for k in pick) / len(pick))
        diffs.sort()
        delta = (sum(sum(a[k]) / len(a[k]) for k in keys) - sum(sum(b[k]) / len(b[k]) for k in keys)) / len(keys)
        out[fam] = {"instances": len(keys), "before": {"value": eb, "ci95": [lb, hb]},
                    "after": {"value": ea, "ci95": [la, ha]},
                    "delta": {"value": delta, "ci95": [diffs[int(0.025 * resamples)],
                                                       diffs[int(0.975 * resamples)]]},
                    "cis_overlap": not (la > hb or lb > ha)}
    return out


def format_family_report(report: dict[str, Any]) -> str:
    head = (f"{'family':<14} {'inst':>4} {'eps':>4} {'infra':>5} {'pass@1 [95% CI]':>22} "
            f"{'reward':>7} {'turns':>5} {'called':>6} {'parsed':>6}")
    lines = [head, "-" * len(head)]
    for fam, r in report.items():
        p = r["pass@1"]
        lines.append(
            f"{fam[:14]:<14} {r['instances']:>4} {r['episodes']:>4} {r['infra_errors']:>5} "
            f"{p['value']:>8.3f} [{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}] "
            f"{r['mean_reward']['value']:>7.3f} {r['turns']['value']:>5.2f} "
            f"{r['called_a_tool']['value']:>6.2f} {r['tool_call_parse_rate']:>6.2f}")
    return "\n".join(lines)


def format_comparison(cmp: dict[str, Any]) -> str:
    head = (f"{'family':<14} {'inst':>4} {'before [95% CI]':>22} {'after [95% CI]':>22} "
            f"{'delta [95% CI]':>24} overlap")
    lines = [head, "-" * len(head)]
    for fam, r in cmp.items():
        def cell(x: dict[str, Any]) -> str:
            return f"{x['value']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}]"
        lines.append(f"{fam[:14]:<14} {r['instances']:>4} {cell(r['before']):>22} "
                     f"{cell(r['after']):>22} {cell(r['delta']):>24} "
                     f"{'yes' if r['cis_overlap'] else 'no'}")
    return "\n".join(lines)


def load_trajectories(path: str) -> list[Trajectory]:
    import msgspec

    dec = msgspec.json.Decoder(Trajectory)
    with open(path, "rb") as f:
        return [dec.decode(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    """`python -m rl360.launch.eval_stats BEFORE.jsonl AFTER.jsonl`: the comparison of two
    evals' trajectories, offline."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--json", default="", help="also write the comparison here")
    a = p.parse_args(argv)
    cmp = compare(load_trajectories(a.before), load_trajectories(a.after))
    print(format_comparison(cmp))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(cmp, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
