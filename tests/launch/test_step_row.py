"""A training step's row (rl360.launch.step_row.StepRow) as metrics.jsonl has it: one flat
mapping, slash keys by their names, figures the step does not have left out, None written for
a figure the trainer did not report, and the run's own families beside the fields."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from rl360.launch.step_row import (
    ENGINE_MAXIMA,
    TRAINER_OPTIONAL,
    StepRow,
    engine_maxima,
    sync_detail,
)


def _row(**extra: Any) -> StepRow:
    fields = {f.name: 0.0 for f in msgspec.structs.fields(StepRow)
              if f.required and f.name != "staleness_hist"}
    return StepRow(**{**fields, "staleness_hist": {"0": 3}, **extra})


def test_the_row_is_flat_with_the_logged_names() -> None:
    row = _row(loss=None, families={"domain/code/reward_mean": 0.5, "count/parked": 1,
                                    "eval/reward_mean": 0.25, "startup/engines_s": 3.0})
    got = row.metrics()
    assert "time/rollout_wait_s" in got and "time/engine_busy_s" in got
    assert not any(k.startswith("time_") for k in got)
    assert got["loss"] is None  # not reported: written as None
    assert not set(TRAINER_OPTIONAL) & set(got) and "sync_put_s" not in got  # left out
    assert not any(k.startswith("engine_sync_pause") for k in got)
    assert got["domain/code/reward_mean"] == 0.5 and got["startup/engines_s"] == 3.0
    assert "families" not in got and got["staleness_hist"] == {"0": 3}


def test_the_optional_figures_are_written_when_the_step_has_them() -> None:
    engines = {"r1": {"sync_pause_max_s": 0.2, "step_median_s": math.nan},
               "r2": {"sync_pause_max_s": 0.3}}
    maxima = engine_maxima(engines)
    assert maxima == {"engine_sync_pause_max_s": 0.3}  # NaN and missing values skipped
    row = _row(**maxima, **sync_detail({"put_s": 0.01, "slot": "ab"}), seq_masked_frac=0.1)
    got = row.metrics()
    assert got["engine_sync_pause_max_s"] == 0.3
    assert got["sync_put_s"] == 0.01 and got["sync_slot"] == 1.0
    assert got["seq_masked_frac"] == 0.1
    # every engine figure the row may carry is one of its fields
    names = {f.encode_name for f in msgspec.structs.fields(StepRow)}
    assert {f"engine_{k}" for k in ENGINE_MAXIMA} <= names
    assert set(TRAINER_OPTIONAL) <= names
