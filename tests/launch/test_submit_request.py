"""`rl360 submit` without a cluster: the job request, and Ctrl-C while following."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from rl360.launch import submit as sub
from rl360.launch.submit import build_request, dashboard_url, on_interrupt
from rl360.recipe import RecipeError

REPO = Path(__file__).resolve().parents[2]


def test_request_for_train() -> None:
    req = build_request(str(REPO / "recipes" / "cpu-demo.toml"), ["trainer.lr=2e-5"],
                        env=["FOO=bar baz"], submission_id="job-1")
    assert req.entrypoint == "python -m rl360 train recipes/cpu-demo.toml --set trainer.lr=2e-5"
    assert req.submission_id == "job-1"
    env = req.runtime_env
    assert env["working_dir"] == str(REPO)
    assert {".venv", "runs", ".git"} <= set(env["excludes"])
    assert env["env_vars"]["RAY_USAGE_STATS_ENABLED"] == "0"
    assert env["env_vars"]["FOO"] == "bar baz"
    assert req.metadata["rl360_recipe"] == "recipes/cpu-demo.toml"


def test_request_for_other_commands_and_default_id() -> None:
    req = build_request(str(REPO / "recipes/cpu-demo.toml"), ["run.name=my run!"], "serve",
                        "--duration 20", working_dir=REPO)
    assert req.entrypoint == ("python -m rl360 serve recipes/cpu-demo.toml --set "
                              "'run.name=my run!' --duration 20")
    assert req.submission_id.startswith("rl360-my-run-")


def test_request_refuses_a_recipe_outside_the_working_dir(tmp_path: Path) -> None:
    p = tmp_path / "r.toml"
    p.write_text("")
    with pytest.raises(RecipeError, match="outside the working dir"):
        build_request(str(p), [], working_dir=REPO)
    with pytest.raises(RecipeError, match="--env 'X': expected KEY=VALUE"):
        build_request(str(REPO / "recipes/cpu-demo.toml"), [], env=["X"], working_dir=REPO)


def test_dashboard_url() -> None:
    assert dashboard_url("127.0.0.1:8265/") == "http://127.0.0.1:8265"
    assert dashboard_url("https://ray.example") == "https://ray.example"


class FakeClient:
    def __init__(self) -> None:
        self.stopped: list[str] = []
        self.submitted: dict[str, Any] = {}

    def submit_job(self, **kw: Any) -> str:
        self.submitted = kw
        return kw["submission_id"]

    async def tail_job_logs(self, job_id: str):  # type: ignore[no-untyped-def]
        yield "line 1\n"
        raise KeyboardInterrupt

    def stop_job(self, job_id: str) -> bool:
        self.stopped.append(job_id)
        return True

    def get_job_status(self, job_id: str) -> str:
        return "RUNNING"


def test_ctrl_c_without_a_terminal_leaves_the_job_running(
    capsys: pytest.CaptureFixture[str],
) -> None:
    client = FakeClient()
    assert on_interrupt(client, "j1", "http://h:8265", interactive=False) == 130
    assert client.stopped == []
    err = capsys.readouterr().err
    assert "job j1 keeps running (stdin is not a terminal" in err
    assert "ray job stop --address http://h:8265 j1" in err


def test_ctrl_c_on_a_terminal_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    client = FakeClient()
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    on_interrupt(client, "j1", "http://h:8265", interactive=True)
    assert client.stopped == ["j1"]
    monkeypatch.setattr("builtins.input", lambda prompt: "")
    on_interrupt(client, "j2", "http://h:8265", interactive=True)
    assert client.stopped == ["j1"]


def test_submit_follow_interrupted(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    import ray.job_submission

    client = FakeClient()
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", lambda address: client)
    monkeypatch.setattr(sub.sys.stdin, "isatty", lambda: False, raising=False)
    args = argparse.Namespace(recipe=str(REPO / "recipes/cpu-demo.toml"), overrides=[],
                              entrypoint_cmd="eval",
                              extra_args="", working_dir=str(REPO), env=[], submission_id="j9",
                              address="127.0.0.1:8265", follow=True)
    assert sub.submit_command(args) == 130
    out = capsys.readouterr()
    assert "rl360: submitted j9" in out.out and "http://127.0.0.1:8265/#/jobs/j9" in out.out
    assert "line 1" in out.out and "keeps running" in out.err
    assert client.submitted["entrypoint"] == "python -m rl360 eval recipes/cpu-demo.toml"
    assert client.stopped == []
