"""MetricsSink starts wandb on a thread of its own (it takes seconds, and the run's start-up
must not wait for it): rows logged before wandb is up reach it once it is, in order, and
closing waits for it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from rl360.actors import metrics


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, Any]]] = []
        self.finished = False

    def log(self, values: dict[str, Any], step: int) -> None:
        self.logged.append((step, values))

    def finish(self) -> None:
        self.finished = True


def test_rows_before_wandb_is_up_reach_it_in_order(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    gate, run = threading.Event(), FakeRun()

    def slow_start(*_: Any) -> FakeRun:
        assert threading.current_thread().name == "rl360-wandb-start"
        gate.wait(10)
        return run

    monkeypatch.setattr(metrics, "_start_wandb", slow_start)
    sink = metrics.MetricsSink(tmp_path, "r", 3, "offline", {})
    sink.log({"step": 1, "reward_mean": 0.1, "note": "text is not logged"})
    sink.log({"step": 2, "reward_mean": 0.2})
    assert run.logged == []  # not up yet: the rows wait, the run goes on
    gate.set()
    sink._wandb_thread.join(10)  # type: ignore[union-attr]
    sink.log({"step": 3, "reward_mean": 0.3})
    assert [s for s, _ in run.logged] == [1, 2, 3]
    assert run.logged[0][1] == {"step": 1, "reward_mean": 0.1}
    sink.close()
    assert sink.close() is None and run.finished
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_close_waits_for_a_slow_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = FakeRun()
    gate = threading.Event()
    monkeypatch.setattr(metrics, "_start_wandb", lambda *_: gate.wait(10) and run)
    sink = metrics.MetricsSink(tmp_path, "r", 1, "offline", {})
    sink.log({"step": 1, "reward_mean": 0.5})
    threading.Timer(0.2, gate.set).start()
    sink.close()
    assert run.logged == [(1, {"step": 1, "reward_mean": 0.5})] and run.finished


def test_disabled_starts_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "_start_wandb", lambda *_: pytest.fail("wandb started"))
    sink = metrics.MetricsSink(tmp_path, "r", 1, "disabled", {})
    sink.log({"step": 1, "reward_mean": 0.5})
    sink.close()
    assert not (tmp_path / "wandb").exists()
