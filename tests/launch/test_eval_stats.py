"""rl360 eval's report as a paper would give it: per-family rows with bootstrap CIs over
instances, the before/after comparison, and the accounting of the tool calls a model wrote."""

from __future__ import annotations

import pytest

from rl360.launch.eval_stats import (
    bootstrap_ci,
    call_accounting,
    compare,
    family_report,
    format_comparison,
    format_family_report,
    generated_turns,
)
from rl360.types import Reward, Trajectory


def traj(task: str, fam: str, ok: bool, status: str = "ok", calls: int = 1,
         mask: list[int] | None = None) -> Trajectory:
    mask = mask if mask is not None else [0, 1, 1, 0, 1]
    return Trajectory(session_id="s", tokens=[0] * len(mask), mask=mask,
                      logprobs=[None] * len(mask), versions=[None] * len(mask),
                      provenance=[""] * len(mask), task_id=task, domain=fam,
                      status=status,  # type: ignore[arg-type]
                      counters={"tool_calls": calls, "malformed_tool_calls": 0},
                      reward=None if status == "infra_error" else Reward(float(ok)))


def test_bootstrap_ci_brackets_the_mean_and_narrows_with_instances() -> None:
    est, lo, hi = bootstrap_ci([[1.0], [0.0]] * 8)
    assert est == 0.5 and lo < 0.5 < hi
    _est2, lo2, hi2 = bootstrap_ci([[1.0], [0.0]] * 128)
    assert hi2 - lo2 < (hi - lo) / 2
    assert bootstrap_ci([[1.0, 1.0]] * 5) == (1.0, 1.0, 1.0)


def test_attempts_of_one_instance_are_resampled_together() -> None:
    """8 attempts of each of 2 instances are 2 samples, not 16: the CI stays wide."""
    _, lo, hi = bootstrap_ci([[1.0] * 8, [0.0] * 8])
    assert (lo, hi) == (0.0, 1.0)


def test_family_rows_skip_infra_failures_and_count_turns() -> None:
    trajs = [traj("a1", "count", True), traj("a1", "count", False), traj("b1", "grep", False),
             traj("b1", "grep", False, status="infra_error", calls=0)]
    rep = family_report(trajs)
    assert rep["count"]["pass@1"]["value"] == 0.5
    assert rep["grep"]["episodes"] == 1 and rep["grep"]["infra_errors"] == 1
    assert rep["all"]["instances"] == 2 and rep["all"]["turns"]["value"] == 2.0
    assert "count" in format_family_report(rep)
    assert generated_turns(traj("x", "f", True, mask=[1, 1, 0, 0, 1, 0, 1])) == 3


def test_compare_reports_the_difference_and_whether_cis_overlap() -> None:
    before = [traj(f"t{i}", "f", False) for i in range(64)]
    after = [traj(f"t{i}", "f", i % 2 == 0) for i in range(64)]
    cmp = compare(before, after)
    row = cmp["all"]
    assert row["instances"] == 64 and row["delta"]["value"] == pytest.approx(0.5)
    assert row["delta"]["ci95"][0] > 0.3 and not row["cis_overlap"]
    same = compare(before, before)["all"]
    assert same["delta"]["value"] == 0.0 and same["cis_overlap"]
    assert "overlap" in format_comparison(cmp)


def test_call_accounting_counts_parsed_malformed_and_unseen(renderer) -> None:  # type: ignore[no-untyped-def]
    texts = [
        '<tool_call>[{"name": "bash", "arguments": {"command": "ls"}}]</tool_call>',
        '<tool_call>[{"name": "bash", "arguments": {"command": "ls"}, ]</tool_call>',
        '<tool_call>[{"name": "bash", "argu',
        'I would run {"name": "bash", "arguments": {"command": "ls"}} here',
        "The file has 12 lines.",
    ]
    acc = call_accounting(texts, renderer.parse_assistant)
    assert (acc["parsed"], acc["malformed"], acc["unseen"]) == (1, 2, 1)
    assert acc["accounted"] == pytest.approx(3 / 4)
    assert sum(acc["reasons"].values()) == 2
