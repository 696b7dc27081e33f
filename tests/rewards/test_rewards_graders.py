"""The built-in reward functions, the registry and the guard."""

from __future__ import annotations

import math

import pytest

from rl360.rewards import (
    RewardContext,
    build_reward,
    guarded,
    normalize_answer,
    reward_error_counts,
)
from rl360.types import Reward


def test_tests_passed_and_all_pass():
    r = build_reward("tests_passed")(RewardContext(tests_passed=3, tests_total=4))
    assert r.value == 0.75 and r.components == {"tests_passed": 0.75, "all_pass": 0.0}
    r = build_reward("tests_passed")(RewardContext(tests_passed=4, tests_total=4))
    assert r.value == 1.0 and r.components["all_pass"] == 1.0
    assert build_reward("tests_passed")(RewardContext()).value == 0.0
    assert build_reward("all_pass")(RewardContext(tests_passed=2, tests_total=2)).value == 1.0
    assert build_reward("all_pass")(RewardContext(tests_passed=1, tests_total=2)).value == 0.0
    assert build_reward("all_pass")(RewardContext(tests_passed=0, tests_total=0)).value == 0.0


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("  42. ", "42"),
        ("The   Answer\n is  Paris!", "the answer is paris"),
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("$x^2$", "x^2"),
        ("Hello?!", "hello"),
        ("ÉCOLE", "école"),
    ],
)
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_exact_answer():
    fn = build_reward("exact_answer")
    assert fn(RewardContext(answer="The answer: \\boxed{ 7 }", reference="7")).value == 1.0
    assert fn(RewardContext(answer="paris.", reference=["Lyon", "PARIS"])).value == 1.0
    assert fn(RewardContext(answer="8", reference="7")).value == 0.0
    assert fn(RewardContext(answer=None, reference="7")).value == 0.0
    fixed = build_reward("exact_answer", reference="yes")
    assert fixed(RewardContext(answer="Yes.")).components == {"exact": 1.0}


def test_format_penalty():
    fn = build_reward("format_penalty", penalty=0.3)
    assert fn(RewardContext()).value == 0.0
    bad = fn(RewardContext(malformed_tool_calls=2))
    assert bad.value == pytest.approx(-0.3) and bad.components["malformed_tool_calls"] == 2.0
    none = fn(RewardContext(has_final_answer=False))
    assert none.value == pytest.approx(-0.3) and none.components["no_final_answer"] == 1.0
    graded = build_reward("format_penalty", penalty=0.5, per_malformed=0.1)
    assert graded(RewardContext(malformed_tool_calls=2)).value == pytest.approx(-0.2)
    assert graded(RewardContext(malformed_tool_calls=9)).value == pytest.approx(-0.5)


def test_weighted_composition():
    fn = build_reward(
        "weighted",
        terms=[{"name": "tests_passed", "weight": 1.0}, {"name": "format_penalty", "penalty": 0.3}],
    )
    r = fn(RewardContext(tests_passed=1, tests_total=2, malformed_tool_calls=1))
    assert r.value == pytest.approx(0.5 - 0.3)
    assert r.components["tests_passed"] == 0.5 and r.components["format_penalty"] == -0.3
    assert r.components["all_pass"] == 0.0
    short = build_reward("weighted", terms={"all_pass": 2.0, "tests_passed": 1.0})
    assert short(RewardContext(tests_passed=2, tests_total=2)).value == 3.0


def test_raising_reward_is_a_counted_error_not_a_crash():
    def broken(ctx: RewardContext) -> Reward:
        raise KeyError("missing field")

    before = reward_error_counts().get("broken", 0)
    r = guarded(broken)(RewardContext())
    assert r.value == 0.0 and r.components == {"reward_error": 1.0}
    assert "KeyError" in r.info["reward_error"]
    assert reward_error_counts()["broken"] == before + 1
    # exact_answer without any reference raises inside: graded as an error
    r = build_reward("exact_answer")(RewardContext(answer="x"))
    assert r.components["reward_error"] == 1.0 and "reference" in r.info["reward_error"]


def test_guard_rejects_garbage_and_accepts_floats():
    assert guarded(lambda ctx: 0.5)(RewardContext()).value == 0.5
    nan = guarded(lambda ctx: math.nan)(RewardContext())
    assert nan.components == {"reward_error": 1.0}
    wrong = guarded(lambda ctx: "1.0")(RewardContext())
    assert "not a Reward" in wrong.info["reward_error"]


def test_weighted_term_error_keeps_other_terms():
    def broken(ctx: RewardContext) -> Reward:
        raise RuntimeError("boom")

    fn = build_reward("weighted", terms=[(broken, 1.0), (build_reward("all_pass"), 1.0)])
    r = fn(RewardContext(tests_passed=1, tests_total=1))
    assert r.value == 1.0 and r.components["reward_error"] == 1.0


def test_registry_errors_are_clear():
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        build_reward("nope")
    with pytest.raises(ValueError, match="bad parameters for reward 'tests_passed'"):
        build_reward("tests_passed", weight=3)
