"""Relative run paths inside a Ray job land under a lasting root, not in the job's working dir
copy (which Ray deletes with the session); outside a job nothing moves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl360.launch.paths import JOB_CONFIG_ENV, RUNS_ROOT_ENV, in_uploaded_job, resolve_run_paths
from rl360.recipe import Recipe, apply_overrides, decode_recipe


def _demo() -> Recipe:
    """The CPU demo's layout: outputs under runs/, the warm start written by sft, read by train."""
    return decode_recipe(apply_overrides({}, [
        "run.out_dir=runs", "sft.out=runs/cpu-demo-warmstart", "train.init=runs/cpu-demo-warmstart"]))


def _job_env(monkeypatch: pytest.MonkeyPatch, working_dir: str | None) -> None:
    runtime_env = {"working_dir": working_dir} if working_dir else {}
    monkeypatch.setenv(JOB_CONFIG_ENV, json.dumps({"runtime_env": runtime_env, "metadata": {}}))


def test_nothing_moves_outside_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(JOB_CONFIG_ENV, raising=False)
    monkeypatch.delenv(RUNS_ROOT_ENV, raising=False)
    r = _demo()
    assert resolve_run_paths(r) == ""
    assert (r.run.out_dir, r.train.init, r.sft.out) == ("runs", "runs/cpu-demo-warmstart",
                                                        "runs/cpu-demo-warmstart")


def test_a_job_with_a_working_dir_writes_under_home(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    monkeypatch.delenv(RUNS_ROOT_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # the working dir copy: no runs/ in it (gitignored)
    _job_env(monkeypatch, "gcs://_ray_pkg_abc.zip")
    assert in_uploaded_job()
    r = _demo()
    note = resolve_run_paths(r)
    root = tmp_path / "rl360"
    assert str(root) in note and RUNS_ROOT_ENV in note
    assert r.run.out_dir == str(root / "runs")
    # the warm start moves with sft.out, so `rl360 train` finds (or writes) it in one place
    assert r.train.init == r.sft.out == str(root / "runs/cpu-demo-warmstart")


def test_a_job_without_a_working_dir_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUNS_ROOT_ENV, raising=False)
    _job_env(monkeypatch, None)
    assert not in_uploaded_job()
    r = _demo()
    assert resolve_run_paths(r) == ""
    assert r.run.out_dir == "runs"


def test_runs_root_env_wins_and_a_shipped_init_stays(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setenv(RUNS_ROOT_ENV, str(tmp_path / "root"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "init").mkdir(parents=True)  # a model dir inside the working dir
    r = _demo()
    r.train.init = "models/init"
    r.run.out_dir = "/abs/runs"
    resolve_run_paths(r)
    assert r.train.init == "models/init"
    assert r.run.out_dir == "/abs/runs"
    assert r.sft.out == str(tmp_path / "root" / "runs/cpu-demo-warmstart")
