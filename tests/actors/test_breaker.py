"""The rollout controller's circuit breaker (rl360.actors.breaker): it trips on a run of
all-infrastructure groups or on a high infrastructure rate over its window, names the top
reasons with ids blanked, and holds while groups score."""

from __future__ import annotations

from rl360.actors.breaker import CircuitBreaker, reason_key
from rl360.recipe import BreakerSection
from rl360.types import EpisodeRecord


def _group(statuses: list[str], error: str = "sandbox rl360-3f9a2c start failed: pid 4411") -> list[EpisodeRecord]:
    return [EpisodeRecord("t", "g", s, None, error=error if s == "infra_error" else None)  # type: ignore[arg-type]
            for s in statuses]


def test_reasons_group_the_same_failure() -> None:
    assert reason_key("sandbox rl360-3f9a2c start failed: pid 4411") == \
        reason_key("sandbox rl360-77be01 start failed: pid 12") == "sandbox rl360-# start failed: pid #"


def test_it_trips_after_the_groups_in_a_row_and_says_why() -> None:
    breaker = CircuitBreaker(BreakerSection(groups=3))
    assert breaker.observe(_group(["infra_error"] * 2)) == ""
    assert breaker.observe(_group(["infra_error"] * 2)) == ""
    why = breaker.observe(_group(["infra_error"] * 2))
    assert why.startswith("circuit breaker: 3 groups in a row failed on the infrastructure")
    assert "6x sandbox rl360-# start failed: pid #" in why


def test_a_scored_episode_breaks_the_row_and_the_rate_trips_on_a_full_window() -> None:
    breaker = CircuitBreaker(BreakerSection(groups=2, window=4, infra_rate=0.6))
    assert breaker.observe(_group(["infra_error", "ok"])) == ""
    assert breaker.observe(_group(["infra_error", "ok"])) == ""  # 50% over a full window
    assert "75% of the last 4 episodes" in breaker.observe(_group(["infra_error", "infra_error"]))
