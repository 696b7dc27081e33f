"""The Env API end to end, as a new user meets it: a package of their own (written here to a
temporary folder, put on PYTHONPATH, nothing of it in RL360) holding an env class and an agent
function, named in a recipe, loaded by the env actors and trained with `rl360 train`. Tasks of
a kind no env is named after run with the agent function (a plain sandbox), and a run that
stops, however it stops (its circuit breaker, Ctrl-C), leaves no process of any sandbox behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from rl360.weights.transports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]

USER_ENV = '''
from rl360.envs.api import Env, EnvStart
from rl360.types import Message, Reward


class EchoEnv(Env):
    """Say the task's word back."""

    def __init__(self, bonus: float = 0.0) -> None:
        self.bonus = bonus

    async def setup(self, task, sandbox):
        self.task = task
        await sandbox.exec(["true"], timeout=30)
        return EnvStart(messages=[Message(role="user", content=task.prompt)])

    async def verify(self):
        said = float(self.task.data["word"] in (self.final_answer or ""))
        return Reward(min(1.0, said + self.bonus), {"said": said})
'''
USER_AGENT = '''
import asyncio
import json
import os
import uuid

from rl360.types import Reward


async def run(task, client, sandbox):
    """Ask the policy once; the sandbox is a plain one (no env class)."""
    await sandbox.exec(["echo", task.data["word"]], timeout=30)
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task.prompt}], max_tokens=16)
    text = reply.choices[0].message.content or ""
    return Reward(float(task.data["word"] in text), {"said": float(task.data["word"] in text)})


async def linger(task, client, sandbox):
    """Leave a process running in the sandbox (marked by the task) and note the sandbox's
    host pids (an agent function runs in the env actor), then fail on `fail` tasks at once (an
    infrastructure failure: the circuit breaker counts it) or wait."""
    marker = task.data["marker"]
    await sandbox.exec(f"nohup python3 -c 'import time; time.sleep(900)' {marker} "
                       ">/dev/null 2>&1 &", timeout=30)
    pids = await sandbox.host_pids()
    with open(os.path.join(task.data["pids_dir"], uuid.uuid4().hex), "w") as f:
        json.dump(pids, f)
    if task.data.get("fail"):
        raise RuntimeError("this agent fails on purpose")
    await asyncio.sleep(900)
    return Reward(0.0)
'''


@pytest.fixture
def user_pkg(tmp_path: Path) -> Path:
    pkg = tmp_path / "user" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "echo_env.py").write_text(textwrap.dedent(USER_ENV))
    (pkg / "agent.py").write_text(textwrap.dedent(USER_AGENT))
    tasks = [{"id": f"say-{w}", "prompt": f"Say the word {w}.", "kind": "echo",
              "data": {"word": w}} for w in ("apple", "pear")]
    (tmp_path / "echo.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return tmp_path


def run_env(root: Path) -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
            "WANDB_MODE": "offline", "PYTHONPATH": str(root / "user")}


def train_cmd(root: Path, steps: int, tasks: str, *sets: str) -> list[str]:
    args = [sys.executable, "-m", "rl360", "train", "recipes/cpu-demo.toml"]
    for s in ("train.init=''", "model.path='tiny'", "run.name='user'",
              f"run.out_dir={json.dumps(str(root / 'runs'))}", "ray.dashboard=false",
              f"serve.port={free_port()}", "env.actors=1", "engine.num_cpus=0.5",
              "trainer.num_cpus=0.5", f"train.steps={steps}", "train.group_size=2",
              "train.groups_per_batch=2", f"train.tasks=[{json.dumps(tasks)}]",
              "train.sampling.max_tokens=16", "train.parking.after=0", "train.checkpoints.every=0",
              "train.oversampling=true", *sets):
        args += ["--set", s]
    return args


def step_rows(root: Path) -> list[dict]:
    p = root / "runs" / "user" / "metrics.jsonl"
    return [r for r in map(json.loads, p.open()) if "reward_mean" in r] if p.exists() else []


def check_trained(root: Path, out: subprocess.CompletedProcess[str], steps: int) -> None:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = step_rows(root)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["episodes"] >= 1 and r["infra_rate"] == 0.0, r
        assert "component/said/mean" in r, sorted(r)


def test_a_users_env_class_trains(user_pkg: Path) -> None:
    cmd = train_cmd(user_pkg, 3, str(user_pkg / "echo.jsonl"),
                    "env.env='mypkg.echo_env:EchoEnv'", "env.params.bonus=0.25")
    out = subprocess.run(cmd, cwd=REPO, env=run_env(user_pkg), capture_output=True, text=True,
                         timeout=800)
    check_trained(user_pkg, out, 3)
    # its own parameter reached it: every reward is at least the bonus
    assert all(r["reward_mean"] >= 0.25 for r in step_rows(user_pkg))


def test_a_users_agent_function_trains_on_tasks_no_env_is_named_after(user_pkg: Path) -> None:
    cmd = train_cmd(user_pkg, 3, str(user_pkg / "echo.jsonl"), "env.agent_fn='mypkg.agent:run'")
    out = subprocess.run(cmd, cwd=REPO, env=run_env(user_pkg), capture_output=True, text=True,
                         timeout=800)
    check_trained(user_pkg, out, 3)


def marked(marker: str) -> list[int]:
    """Host pids of processes whose command line holds `marker`."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker.encode() in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                continue
    return [p for p in pids if p != os.getpid()]


def lingering_run(root: Path, marker: str, fail: bool) -> subprocess.Popen[str]:
    (root / "pids").mkdir()
    tasks = [{"id": f"t{i}", "prompt": "x", "kind": "echo",
              "data": {"marker": marker, "fail": fail and i > 0, "pids_dir": str(root / "pids")}}
             for i in range(3)]
    (root / "linger.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    cmd = train_cmd(root, 50, str(root / "linger.jsonl"), "env.agent_fn='mypkg.agent:linger'",
                    "train.breaker.groups=3", "train.max_in_flight_groups=8",
                    "train.episode_reruns=0")
    # SIGINT as a terminal's Ctrl-C delivers it (a shell's background job would ignore it)
    return subprocess.Popen(cmd, cwd=REPO, env=run_env(root), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def present(pid: int) -> bool:
    """The process exists, alive or a zombie nobody reaped."""
    return Path(f"/proc/{pid}").exists()


def wait_for(cond, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.5)
    return cond()


@pytest.mark.parametrize("how", ["breaker", "ctrl-c"])
def test_a_run_that_stops_leaves_no_sandbox_process(user_pkg: Path, how: str) -> None:
    marker = f"rl360-linger-{uuid.uuid4().hex}"
    proc = lingering_run(user_pkg, marker, fail=how == "breaker")
    try:
        # sandboxes are up with a process of the agent's in each
        assert wait_for(lambda: marked(marker) or proc.poll() is not None, 600), "no sandbox"
        assert marked(marker), proc.communicate()[0][-3000:]
        if how == "ctrl-c":  # a terminal's Ctrl-C twice: to the driver's process group
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(2)
            os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if how == "breaker":
        assert proc.returncode == 1 and "circuit breaker" in out, out[-3000:]
    # the driver is gone: so is every process of every sandbox it started, at once, and none
    # was left to the host's init to reap
    assert wait_for(lambda: not marked(marker), 10), (
        f"left behind: {marked(marker)}; {out[-2000:]}")
    pids = {p for f in (user_pkg / "pids").iterdir() for p in json.loads(f.read_text())}
    assert pids and not [p for p in pids if present(p)], [p for p in pids if present(p)]
