"""The rollout controller's circuit breaker: a run whose episodes keep failing on the
infrastructure (sandboxes that do not start, env actors that die) stops with one line naming
the top reasons instead of training on nothing."""

from __future__ import annotations

import collections
import re

from rl360.recipe import BreakerSection
from rl360.types import EpisodeRecord

_IDS = re.compile(r"\b(?=[0-9a-f]*\d)[0-9a-f]{4,}\b|(?<![A-Za-z0-9])\d+")


def reason_key(error: str) -> str:
    """A failure reason with its ids and numbers blanked (sandbox names, pids, ports), so the
    breaker's top reasons group the same failure together."""
    return _IDS.sub("#", error)[:160]


class CircuitBreaker:
    """Trips after `train.breaker.groups` all-infra groups in a row, or when the infra rate
    over the last `window` episodes passes `infra_rate`."""

    def __init__(self, config: BreakerSection) -> None:
        self.cfg = config
        self.all_infra_in_a_row = 0
        self.window: collections.deque[bool] = collections.deque(maxlen=config.window)
        self.reasons: collections.Counter[str] = collections.Counter()

    def observe(self, records: list[EpisodeRecord]) -> str:
        """Take a finished group's records; the reason it trips ("" while it holds)."""
        infra = [r for r in records if r.status == "infra_error"]
        self.reasons.update(reason_key(r.error or "unknown") for r in infra)
        self.window.extend(r.status == "infra_error" for r in records)
        self.all_infra_in_a_row = self.all_infra_in_a_row + 1 if len(infra) == len(records) else 0
        rate = sum(self.window) / len(self.window) if self.window else 0.0
        full = len(self.window) == self.window.maxlen
        why = (f"{self.all_infra_in_a_row} groups in a row failed on the infrastructure"
               if self.all_infra_in_a_row >= self.cfg.groups else
               f"{rate:.0%} of the last {len(self.window)} episodes failed on the "
               "infrastructure" if full and rate > self.cfg.infra_rate else "")
        if not why:
            return ""
        top = "; ".join(f"{n}x {reason}" for reason, n in self.reasons.most_common(3))
        return (f"circuit breaker: {why}; top reasons: {top} (env actor logs: the Ray "
                "dashboard's actor pages, or /tmp/ray/session_latest/logs/worker-*)")
