"""Every shipped example task's reference solution (the demo's code tasks, the showcase Harbor
tasks), run through the real sandbox, scores 1.0; a wrong solution scores less."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl360.envs.agent import ScriptedClient, run_episode
from rl360.envs.api import open_sandbox
from rl360.envs.code import CodeEnv
from rl360.envs.harbor import HarborEnv
from rl360.envs.tasks import iter_tasks
from rl360.types import FunctionCall, Message, ToolCall

pytestmark = pytest.mark.timeout(120)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"
MORE = Path(__file__).resolve().parents[2] / "examples" / "harbor"  # showcase Harbor tasks
TASKS = list(iter_tasks(EXAMPLES)) + list(iter_tasks(MORE))
CODE = [t for t in TASKS if t.kind == "code"]
HARBOR = [t for t in TASKS if t.kind == "harbor"]


async def test_code_references_score_one_and_wrong_less(bwrap_backend, make_sandbox):
    sandbox = make_sandbox(bwrap_backend)  # one sandbox, many gradings (as in an RL step)
    for task in CODE:
        env = CodeEnv()
        await env.setup(task, sandbox)
        good = await env.grade(task.data["reference"])
        assert good.value == 1.0, (task.id, good.info)
        wrong = task.data["reference"].replace("return ", "return None if True else ")
        bad = await env.grade(wrong)
        assert bad.value < 1.0, task.id


async def test_code_episode_in_fresh_sandbox(backend):
    task = CODE[0]
    env = CodeEnv()
    client = ScriptedClient(
        [Message(role="assistant", content=f"```python\n{task.data['reference']}\n```")]
    )
    sandbox = open_sandbox(env, task, backend)
    try:
        res = await run_episode(env, task, sandbox, client)
    finally:
        await sandbox.close()
    assert res.status == "ok" and res.reward.value == 1.0


@pytest.mark.parametrize("task", HARBOR, ids=[t.id for t in HARBOR])
async def test_harbor_solution_scores_one(bwrap_backend, task):
    env = HarborEnv()
    async with open_sandbox(env, task, bwrap_backend) as sandbox:
        await env.setup(task, sandbox)
        before = await env.verify()
        assert before.value < 1.0, "the task is solved before the agent did anything"
        res = await env.run_solution()
        assert res.ok, res
        after = await env.verify()
        assert after.value == 1.0, after.info


async def test_harbor_episode_with_tools(bwrap_backend):
    task = next(t for t in HARBOR if t.id == "fix-mean-bug")

    def call(i: int, name: str, args: str) -> Message:
        tc = ToolCall(id=f"c{i}", function=FunctionCall(name=name, arguments=args))
        return Message(role="assistant", tool_calls=[tc])

    client = ScriptedClient(
        [
            call(0, "read_file", '{"path": "stats.py"}'),
            call(
                1,
                "edit_file",
                '{"path": "stats.py", "old_string": "(len(xs) - 1)", "new_string": "len(xs)"}',
            ),
            call(
                2,
                "bash",
                '{"command": "python3 -c \\"from stats import mean; print(mean([1, 2, 3]))\\""}',
            ),
            Message(role="assistant", content="Fixed the off-by-one in mean."),
        ]
    )
    env = HarborEnv()
    async with open_sandbox(env, task, bwrap_backend) as sandbox:
        res = await run_episode(env, task, sandbox, client)
    assert res.status == "ok" and res.reward.value == 1.0, (res.reason, res.messages[-4:])
    assert "len(xs) - 1" in res.messages[3].content and res.messages[7].content.startswith("2.0")


async def test_harbor_agent_cannot_prefill_or_block_the_reward(bwrap_backend):
    task = next(t for t in HARBOR if t.id == "run-report-script")
    env = HarborEnv()
    async with open_sandbox(env, task, bwrap_backend) as sandbox:
        await env.setup(task, sandbox)
        await sandbox.exec(
            "echo 1 > /logs/verifier/reward.txt; head -c 60000000 /dev/zero > /logs/agent/fill; "
            "mkdir -p /logs/verifier/reward.json; chmod 000 /logs/verifier /logs"
        )
        reward = await env.verify()
    assert reward.value == 0.0
