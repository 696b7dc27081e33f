"""Both ways to launch, against a real Ray head with its dashboard: `ray job submit` runs
`python -m rl360 serve` (the rl360 Serve app shows up in the dashboard's Serve API while it
runs, the job succeeds) and `rl360 train` as the manual writes it (2 steps; the job SUCCEEDED,
the Serve app and the named actors are listed by the dashboard's REST API), then
`rl360 submit --follow` runs and streams a short job.

The head runs as `ray start --head --block` in its own process group with its own temp dir and
ports, and is torn down by signalling that group (never `ray stop`, which would stop every Ray
of this user on the machine)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ports import free_ports

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",  # `python` in entrypoints = this venv
    )
    return env


def _session_pids(temp_dir: str) -> list[int]:
    """Processes of this head (their command lines name its temp dir or session dir)."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if temp_dir.encode() in (p / "cmdline").read_bytes():
                pids.append(int(p.name))
    return pids


@pytest.fixture(scope="module")
def ray_head() -> Iterator[dict[str, str]]:
    if shutil.which("ray", path=str(BIN)) is None:
        pytest.skip("the ray CLI is not installed next to this python")
    temp_dir = tempfile.mkdtemp(prefix="rl360j-", dir="/tmp")  # short: unix socket paths
    flags = ["--port", "--dashboard-port", "--ray-client-server-port",
             "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
             "--runtime-env-agent-port", "--metrics-export-port"]
    ports = dict(zip(flags, free_ports(len(flags)), strict=True))
    dash = ports["--dashboard-port"]
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
           "--dashboard-host", "127.0.0.1", "--num-cpus", "2", "--include-dashboard", "true",
           "--temp-dir", temp_dir, "--disable-usage-stats"]
    for flag, port in ports.items():
        cmd += [flag, str(port)]
    log = open(Path(temp_dir) / "head.log", "wb")  # closed in teardown
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                            start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                _get(f"{url}/api/version")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"ray head did not come up: {(Path(temp_dir) / 'head.log').read_text()[-2000:]}")
                time.sleep(1)
        print(f"ray head up in {time.monotonic() - deadline + 120:.0f}s")
        yield {"dashboard": url, "temp_dir": temp_dir}
    finally:
        t0 = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:  # `ray start --block` shuts down gracefully on SIGTERM, which can take ~30 s here
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        # workers that left the group (job drivers start their own session) but belong to it
        deadline = time.monotonic() + 15
        while (left := _session_pids(temp_dir)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in _session_pids(temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
        print(f"ray head down in {time.monotonic() - t0:.0f}s ({len(left)} stragglers)")


def _job(url: str, job_id: str) -> dict[str, Any]:
    return next(j for j in _get(f"{url}/api/jobs/") if j.get("submission_id") == job_id)


def _rl360_app(url: str) -> dict[str, Any] | None:
    try:
        apps = _get(f"{url}/api/serve/applications/").get("applications") or {}
    except OSError:
        return None
    return apps.get("rl360")


def test_ray_job_submit_runs_rl360_serve(ray_head: dict[str, str]) -> None:
    url = ray_head["dashboard"]
    job_id = f"rl360-serve-test-{os.getpid()}"
    t0 = time.monotonic()
    out = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", url, "--working-dir", ".", "--no-wait",
         "--submission-id", job_id, "--",
         "python", "-m", "rl360", "serve", "recipes/cpu-demo.toml", "--duration", "20",
         "--set", "ray.dashboard=false", "--set", f"serve.port={free_ports(1)[0]}",
         "--set", "engine.num_cpus=0.5"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    app = None
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        status = _job(url, job_id)["status"]
        assert status in ("PENDING", "RUNNING"), _job(url, job_id)
        app = _rl360_app(url)
        if app and app.get("status") == "RUNNING":
            break
        time.sleep(1)
    assert app and app["status"] == "RUNNING", app
    assert {"engine", "session-server"} <= set(app["deployments"])
    while time.monotonic() < deadline and _job(url, job_id)["status"] in ("PENDING", "RUNNING"):
        time.sleep(1)
    job = _job(url, job_id)
    assert job["status"] == "SUCCEEDED", job
    print(f"ray job submit -> serve app running -> SUCCEEDED in {time.monotonic() - t0:.0f}s")


def _actors(url: str) -> list[dict[str, Any]]:
    """Every actor the cluster has seen (alive or dead), from the dashboard's state API."""
    return _get(f"{url}/api/v0/actors?limit=10000")["data"]["result"]["result"]


TRAIN_JOB_SETS = [  # 2 steps of 2 groups x 2 episodes on the tiny model, no warm start
    "run.name=jobtrain", "model.path='tiny'", "train.init=''", "env.actors=1",
    "engine.num_cpus=0.5", "trainer.num_cpus=0.5", "train.steps=2", "train.group_size=2",
    "train.groups_per_batch=2", "train.task_limit=4", "train.tasks=['examples/tasks/code.jsonl']",
    "train.sampling.max_tokens=16", "train.checkpoints.every=0",
]


def test_ray_job_submit_rl360_train(ray_head: dict[str, str], tmp_path: Path) -> None:
    """The manual's `ray job submit --working-dir . -- rl360 train recipes/cpu-demo.toml`, as
    written (the console script, RAY_ADDRESS join), with short-run --set's appended."""
    url = ray_head["dashboard"]
    job_id = f"rl360-train-test-{os.getpid()}"
    root = tmp_path / "runs-root"  # where the job's relative run paths land (RL360_RUNS_ROOT)
    sets = [*TRAIN_JOB_SETS, f"serve.port={free_ports(1)[0]}"]
    t0 = time.monotonic()
    out = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", url, "--working-dir", ".", "--no-wait",
         "--submission-id", job_id,
         "--runtime-env-json", json.dumps({"env_vars": {"RL360_RUNS_ROOT": str(root)}}),
         "--", "rl360", "train", "recipes/cpu-demo.toml",
         *(x for s in sets for x in ("--set", s))],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    seen_app: dict[str, Any] | None = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and _job(url, job_id)["status"] in ("PENDING", "RUNNING"):
        app = _rl360_app(url)
        if app and app.get("status") == "RUNNING" and seen_app is None:
            seen_app = app
        time.sleep(0.5)
    job = _job(url, job_id)
    assert job["status"] == "SUCCEEDED", job
    assert seen_app is not None, "the rl360 Serve app never showed as RUNNING"
    assert {"engine", "session-server"} <= set(seen_app["deployments"])
    names = {a["name"] for a in _actors(url) if a.get("job_id") and a.get("name")}
    for name in ("rl360-trainer-0", "rl360-trajectory-buffer", "rl360-rollout-controller",
                 "rl360-env-0", "rl360-sessions-0", "rl360-weights"):
        assert name in names, sorted(names)
    assert any(n.startswith("SERVE_REPLICA::rl360#engine#") for n in names), sorted(names)
    # the run's outputs outlive the job's working dir: under RL360_RUNS_ROOT
    metrics = root / "runs" / "jobtrain" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (root / "runs" / "jobtrain" / "checkpoints" / "step_000002").is_dir()
    print(f"ray job submit -- rl360 train (2 steps) -> SUCCEEDED in {time.monotonic() - t0:.0f}s")


def test_rl360_submit_follow(ray_head: dict[str, str]) -> None:
    url = ray_head["dashboard"]
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "rl360", "submit", "recipes/cpu-demo.toml", "--address", url,
         "--entrypoint-cmd", "plan", "--follow", "--submission-id", f"rl360-plan-{os.getpid()}"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"rl360: submitted rl360-plan-{os.getpid()}" in out.stdout
    assert f"{url}/#/jobs/rl360-plan-{os.getpid()}" in out.stdout
    assert "planned on" in out.stdout and "NODE" in out.stdout  # the job's streamed logs
    assert out.stdout.rstrip().endswith("SUCCEEDED")
    assert _job(url, f"rl360-plan-{os.getpid()}")["status"] == "SUCCEEDED"
    assert "planned on the live cluster at" in out.stdout  # the job joined via RAY_ADDRESS
    print(f"rl360 submit --follow (plan job) in {time.monotonic() - t0:.0f}s")
