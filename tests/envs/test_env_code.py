"""CodeEnv: code extraction, test running in the sandbox, reward components, hostile answers."""

from __future__ import annotations

import pytest

from rl360.envs.agent import ScriptedClient, run_episode
from rl360.envs.code import CodeEnv, extract_code
from rl360.types import Message, Task

pytestmark = pytest.mark.timeout(60)

TASK = Task(
    id="add7",
    prompt="Write a Python function add_seven(x) that returns x plus 7.",
    data={
        "entry_point": "add_seven",
        "tests": [
            "assert add_seven(0) == 7",
            "assert add_seven(5) == 12",
            "assert add_seven(-7) == 0",
        ],
    },
)


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("Here:\n```python\ndef f(x):\n    return x\n```\nDone.", "def f(x):\n    return x"),
        ("```py\na = 1\n```\n```python\nb = 2\n```", "b = 2"),
        ("```\nc = 3\n```", "c = 3"),
        ("```python\ndef g():\n    return 1", "def g():\n    return 1"),
        ("def add_seven(x):\n    return x + 7", "def add_seven(x):\n    return x + 7"),
        ("<think>maybe ```python\nbad\n```</think>```python\ngood = 1\n```", "good = 1"),
        ("I don't know.", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_code(text, code):
    assert extract_code(text) == code


async def grade(make_sandbox, backend: str, answer: str | None, task: Task = TASK, **params):
    env = CodeEnv(**params)
    await env.setup(task, make_sandbox(backend))
    return await env.grade(answer)


async def test_correct_partial_and_missing(backend, make_sandbox):
    r = await grade(make_sandbox, backend, "```python\ndef add_seven(x):\n    return x + 7\n```")
    assert r.value == 1.0 and r.components["all_pass"] == 1.0 and r.components["format"] == 1.0
    r = await grade(make_sandbox, backend, "def add_seven(x):\n    return abs(x) + 7")
    assert r.value == pytest.approx(2 / 3) and r.components["all_pass"] == 0.0
    r = await grade(make_sandbox, backend, "no idea")
    assert r.value == 0.0 and r.components["format"] == 0.0
    r = await grade(make_sandbox, backend, "def add_seven(x) return x")  # syntax error
    assert r.value == 0.0 and r.components["format"] == 1.0


async def test_hostile_answers_cannot_fake_passes(bwrap_backend, make_sandbox):
    loop = "def add_seven(x):\n    while True:\n        pass"
    r = await grade(make_sandbox, bwrap_backend, loop, per_test_timeout_s=0.3)
    assert r.value == 0.0  # each test hits its time limit, the runner carries on
    fake = "import sys\nfor i in range(3):\n    print('deadbeef', i, 1)\nsys.stdout.flush()\ndef add_seven(x):\n    return -1"
    assert (await grade(make_sandbox, bwrap_backend, fake)).value == 0.0
    exits = "import os\ndef add_seven(x):\n    os._exit(0)"
    assert (await grade(make_sandbox, bwrap_backend, exits)).value == 0.0
    sysexit = "import sys\ndef add_seven(x):\n    sys.exit(0)"
    assert (await grade(make_sandbox, bwrap_backend, sysexit)).value == 0.0


async def test_test_code_string_with_check(bwrap_backend, make_sandbox):
    task = Task(
        id="heval",
        prompt="p",
        data={
            "entry_point": "inc",
            "tests": "def check(candidate):\n    assert candidate(1) == 2\n",
        },
    )
    assert (
        await grade(make_sandbox, bwrap_backend, "def inc(x):\n    return x + 1", task)
    ).value == 1.0
    assert (
        await grade(make_sandbox, bwrap_backend, "def inc(x):\n    return x", task)
    ).value == 0.0


async def test_single_turn_episode_and_format_penalty(bwrap_backend, make_sandbox):
    client = ScriptedClient(
        [Message(role="assistant", content="def add_seven(x):\n    return x + 7")]
    )
    env = CodeEnv(system_prompt="Answer with code only.")
    res = await run_episode(env, TASK, make_sandbox(bwrap_backend), client)
    assert res.status == "ok" and res.reward.value == 1.0
    assert [m.role for m in client.calls[0]] == ["system", "user"]
    # the env's own format_penalty widens the task's range below by the penalty
    client = ScriptedClient([Message(role="assistant", content="seven more than x")])
    res = await run_episode(CodeEnv(format_penalty=0.3), TASK, make_sandbox(bwrap_backend), client)
    assert res.reward.value == pytest.approx(-0.3) and res.reward.components["format"] == 0.0
    assert "reward_clamped" not in res.counters
    # a penalty inside a custom reward is bounded by the task's declared range (default [0, 1])
    penalised = CodeEnv(
        reward="weighted",
        reward_params={
            "terms": [{"name": "tests_passed"}, {"name": "format_penalty", "penalty": 0.3}]
        },
    )
    client = ScriptedClient([Message(role="assistant", content="seven more than x")])
    res = await run_episode(penalised, TASK, make_sandbox(bwrap_backend), client)
    assert res.reward.value == 0.0 and res.counters["reward_clamped"] == 1
    assert res.reward.info["unclamped_reward"] == pytest.approx(-0.3)
    ranged = Task(id=TASK.id, prompt=TASK.prompt, data={**TASK.data, "reward_range": [-1, 1]})
    client = ScriptedClient([Message(role="assistant", content="seven more than x")])
    res = await run_episode(penalised, ranged, make_sandbox(bwrap_backend), client)
    assert res.reward.value == pytest.approx(-0.3)


async def test_tool_using_code_episode(bwrap_backend, make_sandbox):
    from rl360.types import FunctionCall, ToolCall

    call = ToolCall(
        id="c", function=FunctionCall(name="python", arguments='{"code": "print(5 + 7)"}')
    )
    client = ScriptedClient(
        [
            Message(role="assistant", tool_calls=[call]),
            Message(
                role="assistant", content="```python\ndef add_seven(x):\n    return x + 7\n```"
            ),
        ]
    )
    res = await run_episode(CodeEnv(tools=True), TASK, make_sandbox(bwrap_backend), client)
    assert res.status == "ok" and res.reward.value == 1.0
    assert res.messages[-2].role == "tool" and res.messages[-2].content.startswith("12")


async def test_full_disk_does_not_break_grading(bwrap_backend, make_sandbox):
    """A tool-using agent that fills the work dir must still be graded (not an infra error)."""
    sb = make_sandbox(bwrap_backend, disk_mb=8)
    env = CodeEnv()
    await env.setup(TASK, sb)
    await sb.exec("head -c 20000000 /dev/zero > fill.bin")
    assert (await env.grade("def add_seven(x):\n    return x + 7")).value == 1.0
