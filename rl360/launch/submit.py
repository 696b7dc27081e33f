"""`rl360 submit`: `ray job submit` for a recipe, through ray.job_submission.JobSubmissionClient.

The working directory (the repo, without .venv, runs, .git and caches) travels with the job;
the job runs `python -m rl360 <train|eval|...> <recipe> [--set ...]` on the cluster's head,
where RAY_ADDRESS makes it join the cluster. Prints the job id and the dashboard link;
`--follow` streams the logs, and Ctrl-C then asks whether to stop the job (or, when stdin is
not a terminal, leaves it running and says so).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from rl360.recipe import RecipeError, load_recipe

EXCLUDES = [".venv", ".venv-*", "venv", "runs", ".git", "**/__pycache__", "*.egg-info", ".pytest_cache",
            ".ruff_cache", "wandb", "*.pyc"]
JOB_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "PYTHONUNBUFFERED": "1",
    "WANDB_MODE": "offline",
    "TOKENIZERS_PARALLELISM": "false",
}
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class JobRequest(msgspec.Struct, kw_only=True):
    entrypoint: str
    runtime_env: dict[str, Any]
    submission_id: str
    metadata: dict[str, str]


def repo_root() -> Path:
    """The checkout rl360 runs from (has pyproject.toml), else the current directory."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def dashboard_url(address: str) -> str:
    address = address.rstrip("/")
    return address if "://" in address else f"http://{address}"


def build_request(recipe_path: str, overrides: list[str], cmd: str = "train",
                  extra_args: str = "", working_dir: str | Path = "",
                  env: list[str] | None = None, submission_id: str = "") -> JobRequest:
    recipe = load_recipe(recipe_path, overrides)  # fail here, not on the cluster
    wd = Path(working_dir or repo_root()).resolve()
    try:
        rel = Path(recipe_path).resolve().relative_to(wd)
    except ValueError:
        raise RecipeError(
            f"recipe {recipe_path!r} is outside the working dir {wd}: copy it under it "
            "(e.g. recipes/) or pass --working-dir"
        ) from None
    env_vars = dict(JOB_ENV)
    for item in env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"--env {item!r}: expected KEY=VALUE")
        env_vars[key] = value
    parts = ["python", "-m", "rl360", cmd, rel.as_posix()]
    for o in overrides:
        parts += ["--set", o]
    parts += shlex.split(extra_args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    sid = submission_id or f"rl360-{re.sub(r'[^A-Za-z0-9_-]+', '-', recipe.run.name)}-{stamp}"
    return JobRequest(
        entrypoint=shlex.join(parts),
        runtime_env={"working_dir": str(wd), "excludes": list(EXCLUDES), "env_vars": env_vars},
        submission_id=sid,
        metadata={"rl360_recipe": rel.as_posix(), "rl360_run": recipe.run.name,
                  "rl360_command": cmd},
    )


def submit(client: Any, req: JobRequest) -> str:
    return client.submit_job(entrypoint=req.entrypoint, runtime_env=req.runtime_env,
                             submission_id=req.submission_id, metadata=req.metadata)


async def _tail(client: Any, job_id: str) -> None:
    async for lines in client.tail_job_logs(job_id):
        print(lines, end="", flush=True)


def final_status(client: Any, job_id: str, timeout_s: float = 30.0) -> str:
    """The job's status once terminal (logs can end a moment before the status flips)."""
    deadline = time.monotonic() + timeout_s
    status = str(client.get_job_status(job_id))
    while status.split(".")[-1] not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.5)
        status = str(client.get_job_status(job_id))
    return status.split(".")[-1]


def on_interrupt(client: Any, job_id: str, address: str, interactive: bool) -> int:
    """Ctrl-C while following: ask whether to stop the job; never ask without a terminal."""
    if not interactive:
        print(f"\nrl360: stopped following; job {job_id} keeps running (stdin is not a "
              f"terminal, so not asking). Stop it with: ray job stop --address {address} "
              f"{job_id}", file=sys.stderr)
        return 130
    try:
        answer = input(f"\nstop job {job_id} on the cluster? [y/N] ").strip().lower()
    except (EOFError, KeyboardInterrupt):
        answer = ""
    if answer in ("y", "yes"):
        client.stop_job(job_id)
        print(f"rl360: asked the cluster to stop {job_id}", file=sys.stderr)
    else:
        print(f"rl360: job {job_id} keeps running; follow it again with: ray job logs "
              f"--address {address} --follow {job_id}", file=sys.stderr)
    return 130


def submit_command(args: argparse.Namespace) -> int:
    from ray.job_submission import JobSubmissionClient

    req = build_request(args.recipe, args.overrides, args.entrypoint_cmd, args.extra_args,
                        args.working_dir, args.env, args.submission_id)
    address = dashboard_url(args.address)
    try:
        client = JobSubmissionClient(address)
    except Exception as exc:
        print(f"rl360 submit: cannot reach the Ray dashboard at {address} ({exc}); start a "
              "cluster (`ray start --head`) or pass --address", file=sys.stderr)
        return 2
    job_id = submit(client, req)
    print(f"rl360: submitted {job_id}\n  entrypoint  {req.entrypoint}\n"
          f"  dashboard   {address}/#/jobs/{job_id}\n"
          f"  logs        ray job logs --address {address} --follow {job_id}\n"
          f"  stop        ray job stop --address {address} {job_id}", flush=True)
    if not args.follow:
        return 0
    try:
        asyncio.run(_tail(client, job_id))
    except KeyboardInterrupt:
        return on_interrupt(client, job_id, address, sys.stdin.isatty())
    status = final_status(client, job_id)
    print(f"rl360: job {job_id} {status}")
    return 0 if status == "SUCCEEDED" else 1
