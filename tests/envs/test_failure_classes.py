"""Model-caused failures are scored (status error, reward 0), never an unscored infra_error; the
exec server survives what the model can throw at it; Harbor verification runs in a clean room."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from rl360.envs.agent import ScriptedClient, run_episode
from rl360.envs.api import open_sandbox
from rl360.envs.code import CodeEnv
from rl360.envs.harbor import HarborEnv
from rl360.envs.tasks import load_harbor_task
from rl360.envs.tools import ToolBox
from rl360.types import FunctionCall, Message, Task, ToolCall

pytestmark = pytest.mark.timeout(120)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "harbor"


def call(name: str, **args: object) -> ToolCall:
    return ToolCall(id=f"c-{name}", function=FunctionCall(name=name, arguments=json.dumps(args)))


def bash(cmd: str) -> Message:
    return Message(role="assistant", tool_calls=[call("bash", command=cmd)])


async def test_exec_server_ignores_signals(backend, make_sandbox):
    sb = make_sandbox(backend)
    sigs = "INT TERM HUP QUIT USR1 USR2 PIPE ALRM TSTP TTIN TTOU XCPU XFSZ VTALRM PROF WINCH"
    res = await sb.exec(f"for s in {sigs}; do kill -$s $PPID; done; echo sent", timeout=20)
    assert "sent" in res.stdout
    res = await sb.exec("echo alive", timeout=20)
    assert res.stdout.strip() == "alive"
    # the commands themselves still get the default dispositions (SIGPIPE ends `yes`)
    res = await sb.exec("yes | head -c 10 >/dev/null; kill -INT $$; echo not-reached", timeout=20)
    assert "not-reached" not in res.stdout and res.exit_code != 0


async def test_reads_are_capped_and_never_block(backend, make_sandbox):
    sb = make_sandbox(backend)
    box = ToolBox(sb)
    for path in ("/dev/zero", "/dev/urandom"):
        r = await box.call(call("edit_file", path=path, old_string="a", new_string="b"))
        assert not r.ok and "error" in r.content
        r = await box.call(call("read_file", path=path))
        assert not r.ok
    assert (await sb.exec("mkfifo pipe && echo made", timeout=20)).stdout.strip() == "made"
    r = await box.call(call("read_file", path="pipe"))  # would block the server forever
    assert not r.ok
    r = await box.call(call("write_file", path="pipe", content="x"))
    assert not r.ok
    big = await sb.exec("head -c 3000000 /dev/zero | tr '\\0' a > big.txt && echo ok", timeout=20)
    assert big.ok, big
    r = await box.call(call("edit_file", path="big.txt", old_string="aa", new_string="b"))
    assert not r.ok and "larger than" in r.content
    assert (await sb.exec("wc -c < big.txt", timeout=20)).stdout.strip() == "3000000"


async def test_killing_the_sandbox_is_a_scored_error(make_sandbox):
    """On the process backend the model can SIGKILL the exec server: that is its own failure."""
    task = Task(id="t", prompt="p", data={"tests": ["assert True"]})
    client = ScriptedClient(
        [bash("kill -9 $PPID; sleep 5"), Message(role="assistant", content="x")]
    )
    res = await run_episode(CodeEnv(tools=True), task, make_sandbox("process"), client)
    assert res.status == "error", res.reason
    assert res.reward is not None and res.reward.value == 0.0
    assert "sandbox died" in res.reason


def _copy_task(tmp_path: Path, name: str = "fix-mean-bug") -> Path:
    dst = tmp_path / name
    shutil.copytree(EXAMPLES / name, dst)
    return dst


async def test_verifier_without_reward_after_the_agent_is_scored(bwrap_backend, tmp_path):
    root = _copy_task(tmp_path)
    (root / "environment" / "files" / "grade.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (root / "tests" / "test.sh").write_text("#!/bin/bash\nbash /app/grade.sh\n")
    task = load_harbor_task(root)
    env = HarborEnv()
    client = ScriptedClient(
        [bash("rm -f /app/grade.sh"), Message(role="assistant", content="done")]
    )
    async with open_sandbox(env, task, bwrap_backend) as sb:
        res = await run_episode(env, task, sb, client)
    assert res.status == "error", res.reason
    assert res.reward is not None and res.reward.value == 0.0


DAEMONS = {
    "reward writer": "while true; do echo 1 > /logs/verifier/reward.txt 2>/dev/null; done",
    "test rewriter": (
        "while true; do printf '#!/bin/bash\\necho 1 > /logs/verifier/reward.txt\\n' "
        "> /tests/test.sh 2>/dev/null; done"
    ),
    "reward json writer": (
        "while true; do rm -f /logs/verifier/reward.txt; "
        "echo '{\"reward\": 1}' > /logs/verifier/reward.json 2>/dev/null; done"
    ),
}


@pytest.mark.parametrize("daemon", DAEMONS.values(), ids=list(DAEMONS))
async def test_background_process_cannot_change_the_harbor_score(bwrap_backend, daemon):
    """The agent leaves a daemon that rewrites the reward file or the test script during
    verification; it does not change the score (the unsolved task still scores 0)."""
    task = load_harbor_task(EXAMPLES / "fix-mean-bug")
    env = HarborEnv()
    start = f"setsid sh -c {shlex.quote(daemon)} >/dev/null 2>&1 < /dev/null & echo started"
    client = ScriptedClient([bash(start), Message(role="assistant", content="done")])
    async with open_sandbox(env, task, bwrap_backend) as sb:
        res = await run_episode(env, task, sb, client)
        assert "started" in res.messages[-2].content
    assert res.status == "ok", res.reason
    assert res.reward is not None and res.reward.value == 0.0, res.reward
    assert res.reward.info["agent_procs_killed"] >= 1
