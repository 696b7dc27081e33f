"""Verifiers the agent cannot reach: one cheat per door, each run through both harnesses of a
Harbor task (the built-in tool loop: the agent's tool calls leave something behind; the agent
worker: an agent program does the same) on a task the agent leaves unsolved. Each scores what an
idle agent scores (0), or the reward is bounded.

- user site: a `.pth` file in ~/.local of the agent's HOME ran inside the verifier's python3
- module shadowing: a csv.py in the work dir shadowed the one the verifier imports
- out-of-range reward: a verifier passing the agent's number on was taken unbounded
- a daemon left by a tool call: read the code grader's nonce and forged its report lines
- verifier overrun: caused by the agent, it was an unscored infra_error
(StopIteration through map/all/sum: tests/envs/test_code_cheats.py)
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from rl360.envs.agent import ScriptedClient, run_episode
from rl360.envs.agent_worker import AgentWorkerEnv, run_agent_worker
from rl360.envs.api import open_sandbox
from rl360.envs.code import CodeEnv
from rl360.envs.harbor import HarborEnv
from rl360.envs.session_bridge import SessionEndpoint
from rl360.envs.tasks import load_harbor_task
from rl360.recipe import EnvSection, SandboxLimits
from rl360.types import FunctionCall, Message, Task, ToolCall
from tests.envs.test_agent_worker import SAMPLING, StandIn, server  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(180)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
AGENTS = Path(__file__).resolve().parent / "agents"
PY = f"python{sys.version_info.major}.{sys.version_info.minor}"
# what a planted module or .pth file does inside the verifier: write reward 1 when it exits
WRITE_ONE = (
    "import atexit; atexit.register(lambda: open('/logs/verifier/reward.txt', 'w').write('1'))"
)


def bash(cmd: str, i: int = 0) -> Message:
    call = ToolCall(id=f"c{i}", function=FunctionCall(name="bash",
                                                      arguments=json.dumps({"command": cmd})))
    return Message(role="assistant", tool_calls=[call])


def write(path: str, text: str) -> str:
    return f"mkdir -p {shlex.quote(str(Path(path).parent))} && printf %s {shlex.quote(text)} > {shlex.quote(path)} && echo planted"


async def tool_loop(task: Task, *commands: str, cfg: EnvSection | None = None):  # type: ignore[no-untyped-def]
    client = ScriptedClient([*(bash(c, i) for i, c in enumerate(commands)),
                             Message(role="assistant", content="done")])
    env = HarborEnv()
    async with open_sandbox(env, task, "bwrap") as sb:
        res = await run_episode(env, task, sb, client, cfg)
    assert all("planted" in m.content for m in res.messages if m.role == "tool"), res.messages
    return res


@pytest.fixture(params=["tool loop", "agent worker"])
def harbor_episode(request, bwrap_backend, server):  # type: ignore[no-untyped-def]  # noqa: F811
    """An episode of a Harbor task whose agent runs `commands` in its sandbox, through the
    built-in tool loop or the agent worker (an agent program, its model a stand-in server)."""
    if request.param == "tool loop":
        return tool_loop

    async def worker(task: Task, *commands: str, cfg: EnvSection | None = None):  # type: ignore[no-untyped-def]
        env = AgentWorkerEnv(command=("{python}", str(AGENTS / "plant_agent.py"),
                                      " && ".join(commands)), mounts=(str(AGENTS),))
        sandbox = open_sandbox(env, task, "bwrap", SandboxLimits())
        try:
            return await run_agent_worker(
                env, task, sandbox, SessionEndpoint(f"http://127.0.0.1:{server.port}", "s1",
                                                    "tok"), SAMPLING, cfg or EnvSection())
        finally:
            await sandbox.close()
            await env.close()

    return worker


def task_copy(tmp_path: Path, name: str, test_sh: str | None = None,
              verifier: str = "") -> Task:
    src = next(p for p in (EXAMPLES / "harbor" / name, EXAMPLES / "tasks" / "harbor" / name)
               if p.is_dir())
    dst = tmp_path / name
    shutil.copytree(src, dst)
    if test_sh is not None:
        (dst / "tests" / "test.sh").write_text(test_sh)
    if verifier:
        toml = (dst / "task.toml").read_text()
        (dst / "task.toml").write_text(toml.replace("[verifier]\n", f"[verifier]\n{verifier}\n"))
    return load_harbor_task(dst)


async def test_idle_agent_scores_zero(harbor_episode):
    task = load_harbor_task(EXAMPLES / "harbor" / "count-ok-rows")
    res = await harbor_episode(task, "echo planted")
    assert res.status == "ok" and res.reward is not None and res.reward.value == 0.0


async def test_user_site_pth_does_not_run_in_the_verifier(harbor_episode):
    """The agent's HOME was its work dir: a .pth in ~/.local/lib/pythonX.Y/site-packages ran in
    every python3 the verifier started."""
    task = load_harbor_task(EXAMPLES / "harbor" / "count-ok-rows")
    pth = f"/app/.local/lib/{PY}/site-packages/zz-cheat.pth"
    res = await harbor_episode(task, write(pth, WRITE_ONE + "\n"))
    assert res.status == "ok" and res.reward is not None and res.reward.value == 0.0, res.reward


@pytest.mark.parametrize("cd_app", [False, True], ids=["verifier cwd", "verifier cds to /app"])
async def test_a_module_shadowing_the_stdlib_does_not_run(harbor_episode, tmp_path, cd_app):
    """count-ok-rows' verifier imports csv; a csv.py in the work dir (its cwd, and so
    sys.path[0] of `python3 -`) shadowed it. A verifier that cds into the work dir itself is
    covered too (no implicit cwd on sys.path)."""
    test_sh = None
    if cd_app:
        original = (EXAMPLES / "harbor" / "count-ok-rows" / "tests" / "test.sh").read_text()
        test_sh = original.replace("mkdir -p /logs/verifier\n", "mkdir -p /logs/verifier\ncd /app\n")
    task = task_copy(tmp_path, "count-ok-rows", test_sh)
    res = await harbor_episode(task,
                               write("/app/csv.py", WRITE_ONE + "\nDictReader = None\n"))
    assert res.status == "ok" and res.reward is not None and res.reward.value == 0.0, res.reward


PASS_ON = "#!/bin/bash\nmkdir -p /logs/verifier\ncp /app/score /logs/verifier/reward.{kind}\n"


@pytest.mark.parametrize(("kind", "score", "want"), [
    ("txt", "1e9", 1.0), ("txt", "-5", 0.0), ("json", '{"reward": 1e9, "style": 3}', 1.0)])
async def test_out_of_range_rewards_are_clamped_and_counted(harbor_episode, tmp_path, kind,
                                                            score, want):
    task = task_copy(tmp_path, "count-ok-rows", PASS_ON.format(kind=kind))
    res = await harbor_episode(task, write("/app/score", score))
    assert res.status == "ok" and res.reward is not None, res.reason
    assert res.reward.value == want and res.counters["reward_clamped"] == 1, res.reward
    assert res.reward.components["reward_clamped"] == 1.0


async def test_a_task_declares_its_reward_range(harbor_episode, tmp_path):
    task = task_copy(tmp_path, "count-ok-rows", PASS_ON.format(kind="txt"),
                     "reward_range = [-1, 10]")
    assert task.data["reward_range"] == [-1.0, 10.0]
    res = await harbor_episode(task, write("/app/score", "7.5"))
    assert res.reward is not None and res.reward.value == 7.5 and "reward_clamped" not in res.counters
    res = await harbor_episode(task, write("/app/score", "1e9"))
    assert res.reward is not None and res.reward.value == 10.0


async def test_a_non_finite_reward_is_a_scored_error(harbor_episode, tmp_path):
    task = task_copy(tmp_path, "count-ok-rows", PASS_ON.format(kind="json"))
    res = await harbor_episode(task, write("/app/score", '{"reward": NaN}'))
    assert res.status == "error" and res.reward is not None and res.reward.value == 0.0


async def test_a_verifier_the_agent_makes_overrun_is_scored(harbor_episode, tmp_path):
    """The agent's report script hangs when the verifier runs it; the recipe caps verification
    at 3 s (below the task's 60): that was an unscored infra_error."""
    test_sh = ("#!/bin/bash\nmkdir -p /logs/verifier\n"
               "got=$(python3 -I /app/make_report.py)\n"
               "expected=$(python3 -c 'print(sum(v for v in [(i * 37 + 11) % 101 for i in "
               "range(200)] if v % 3 == 0))')\n"
               '[ "$got" = "$expected" ] && echo 1 > /logs/verifier/reward.txt '
               "|| echo 0 > /logs/verifier/reward.txt\n")
    task = task_copy(tmp_path, "run-report-script", test_sh)
    res = await harbor_episode(task,
                               write("/app/make_report.py", "while True:\n    pass\n"),
                               cfg=EnvSection(verify_timeout_s=3.0))
    assert res.status == "error", res.reason
    assert res.reward is not None and res.reward.value == 0.0


async def test_a_verifier_that_overruns_after_writing_a_reward_scores_zero(harbor_episode,
                                                                          tmp_path):
    test_sh = ("#!/bin/bash\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n"
               "python3 -I /app/make_report.py > /dev/null\n")
    task = task_copy(tmp_path, "run-report-script", test_sh, "")
    task.data["verifier_timeout_sec"] = 3.0
    res = await harbor_episode(task,
                               write("/app/make_report.py", "while True:\n    pass\n"))
    assert res.status == "error" and res.reward is not None and res.reward.value == 0.0



# fix-mean-bug's verifier runs the agent's mean() in a child; importing this stats.py starts a
# daemon (double fork, new session) that keeps writing reward 1 after the verifier wrote its own
LEAVES_A_WRITER = """import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for _ in range(5000):
            try:
                open("/logs/verifier/reward.txt", "w").write("1")
            except OSError:
                pass
            time.sleep(0.001)
    os._exit(0)
def mean(xs):
    return 0
"""


async def test_the_agents_code_run_by_a_verifier_leaves_nothing_behind(harbor_episode):
    """The example verifier is its child's subreaper: what the agent's module started is killed
    before the reward is written."""
    task = load_harbor_task(EXAMPLES / "harbor" / "fix-mean-bug")
    res = await harbor_episode(task, write("/app/stats.py", LEAVES_A_WRITER))
    assert res.status == "ok" and res.reward is not None and res.reward.value == 0.0, res.reward

CODE_TASK = Task(id="add7", prompt="Write add_seven(x).", data={
    "entry_point": "add_seven",
    "tests": ["assert add_seven(0) == 7", "assert add_seven(5) == 12", "assert add_seven(-7) == 0"],
})
# started by a tool call, it waits for the grading parent (a new process whose stdin is a
# memfd: the spec with the nonce), opens its stdin and stdout (the report channel) through /proc
# while the parent is still dumpable, and forges a passing line for every test
SNOOPER = r"""
import os, re, time
seen = set(os.listdir("/proc"))
end = time.time() + 60
while time.time() < end:
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid in seen:
            continue
        try:
            if "memfd" not in os.readlink("/proc/%s/fd/0" % pid):
                continue
            spec = open("/proc/%s/fd/0" % pid, "rb")
            out = os.open("/proc/%s/fd/1" % pid, os.O_WRONLY)
        except OSError:
            continue
        seen.add(pid)
        for n in set(re.findall(rb"[0-9a-f]{16}", spec.read())):
            for i in range(3):
                os.write(out, n + b" %d 1 \n" % i)
        os._exit(0)
"""


async def test_a_daemon_started_by_a_tool_call_cannot_forge_the_grade(bwrap_backend):
    """CodeEnv with tools grades in the episode's own sandbox: every process the agent left is
    killed before the grading parent starts."""
    start = (f"printf %s {shlex.quote(SNOOPER)} > /tmp/s.py && "
             "setsid python3 -I /tmp/s.py > /dev/null 2>&1 < /dev/null & echo started")
    client = ScriptedClient([bash(start), Message(role="assistant",
                                                  content="```python\ndef add_seven(x):\n"
                                                          "    return -99\n```")])
    env = CodeEnv(tools=True)
    async with open_sandbox(env, CODE_TASK, bwrap_backend) as sb:
        res = await run_episode(env, CODE_TASK, sb, client)
    assert "started" in res.messages[2].content
    assert res.status == "ok" and res.reward is not None and res.reward.value == 0.0, res.reward
