"""The controller's task stream: pass after pass over the task files, each pass shuffled
through a window, reproducible from the seed (a resume skips ahead in the same stream)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from rl360.actors.task_stream import task_stream


@pytest.fixture
def files(tmp_path: Path) -> list[str]:
    out = []
    for f, ids in (("a.jsonl", range(0, 7)), ("b.jsonl", range(7, 12))):
        p = tmp_path / f
        p.write_text("".join(json.dumps({"id": f"t{i}", "instruction": "x", "tests": ["assert 1"]})
                             + "\n" for i in ids))
        out.append(str(p))
    return out


def ids(stream, n: int) -> list[str]:  # type: ignore[no-untyped-def]
    return [t.id for t in itertools.islice(stream, n)]


def test_window_zero_is_file_order_pass_after_pass(files: list[str]) -> None:
    assert ids(task_stream(files, 0, 0), 14) == [f"t{i}" for i in range(12)] + ["t0", "t1"]
    assert ids(task_stream(files, 5, 0), 7) == ["t0", "t1", "t2", "t3", "t4", "t0", "t1"]


@pytest.mark.parametrize("window", [3, 12, 4096])
def test_every_pass_is_a_new_permutation_reproducible_from_the_seed(files: list[str],
                                                                    window: int) -> None:
    got = ids(task_stream(files, 0, window, seed=7), 36)
    passes = [got[0:12], got[12:24], got[24:36]]
    for p in passes:  # each task exactly once per pass, windowed or not
        assert sorted(p, key=lambda s: int(s[1:])) == [f"t{i}" for i in range(12)]
    assert passes[0] != passes[1] and passes[0] != [f"t{i}" for i in range(12)]
    assert got == ids(task_stream(files, 0, window, seed=7), 36)  # a resume replays it
    assert got != ids(task_stream(files, 0, window, seed=8), 36)


def test_the_limit_applies_before_the_shuffle(files: list[str]) -> None:
    got = ids(task_stream(files, 4, 4096, seed=1), 8)
    assert sorted(got[:4]) == sorted(got[4:]) == ["t0", "t1", "t2", "t3"]


def test_no_tasks_is_a_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "none.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no tasks in"):
        next(task_stream([str(empty)], 0, 16))
