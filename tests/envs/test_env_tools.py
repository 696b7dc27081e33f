"""Built-in tools over a real sandbox: results, and error ToolResults (never exceptions) for
bad arguments."""

from __future__ import annotations

import json

import pytest

from rl360.envs.tools import BUILTIN_TOOLS, ToolBox
from rl360.types import FunctionCall, ToolCall

pytestmark = pytest.mark.timeout(60)


def tc(name: str, args: object) -> ToolCall:
    raw = args if isinstance(args, str) else json.dumps(args)
    return ToolCall(id="c1", function=FunctionCall(name=name, arguments=raw))


def test_specs_are_openai_tool_schemas():
    assert set(BUILTIN_TOOLS) == {"bash", "python", "read_file", "write_file", "edit_file"}
    for tool in BUILTIN_TOOLS.values():
        d = tool.spec.function.parameters
        assert tool.spec.type == "function" and d["type"] == "object"
        assert set(d["required"]) <= set(d["properties"])


async def test_tools_work(backend, make_sandbox):
    box = ToolBox(make_sandbox(backend))
    r = await box.call(tc("bash", {"command": "echo hi; echo oops >&2; exit 2"}))
    assert (
        not r.ok
        and "hi" in r.content
        and "[stderr]\noops" in r.content
        and "[exit code 2]" in r.content
    )
    r = await box.call(tc("python", {"code": "print(sum(range(5)))"}))
    assert r.ok and r.content.startswith("10")
    r = await box.call(tc("write_file", {"path": "pkg/mod.py", "content": "X = 1\nY = 1\n"}))
    assert r.ok and "wrote 12 bytes" in r.content
    r = await box.call(tc("read_file", {"path": "pkg/mod.py"}))
    assert r.ok and r.content == "X = 1\nY = 1\n"
    r = await box.call(
        tc("edit_file", {"path": "pkg/mod.py", "old_string": "X = 1", "new_string": "X = 2"})
    )
    assert r.ok
    assert (await box.call(tc("read_file", {"path": "pkg/mod.py"}))).content == "X = 2\nY = 1\n"
    r = await box.call(
        tc("edit_file", {"path": "pkg/mod.py", "old_string": "= ", "new_string": "="})
    )
    assert not r.ok and "occurs 2 times" in r.content
    r = await box.call(
        tc("edit_file", {"path": "pkg/mod.py", "old_string": "Z", "new_string": "W"})
    )
    assert not r.ok and "not found" in r.content
    r = await box.call(tc("bash", {"command": "sleep 10", "timeout": 0.5}))
    assert not r.ok and "timed out" in r.content


@pytest.mark.parametrize(
    ("name", "args", "expect"),
    [
        ("bash", "{not json", "not valid JSON"),
        ("bash", "[1, 2]", "must be a JSON object"),
        ("bash", {}, "missing required argument(s): command"),
        ("bash", {"command": 5}, "must be string"),
        ("bash", {"command": "ls", "cwd": "/"}, "unknown argument(s)"),
        ("python", {"code": "1", "timeout": True}, "must be number"),
        ("read_file", {"path": "nope.txt"}, "read nope.txt"),
        ("edit_file", {"path": "nope.txt", "old_string": "a", "new_string": "b"}, "nope.txt"),
        ("rm_rf", {"path": "/"}, "unknown tool 'rm_rf'"),
    ],
)
async def test_bad_calls_give_error_results(bwrap_backend, make_sandbox, name, args, expect):
    box = ToolBox(make_sandbox(bwrap_backend))
    r = await box.call(tc(name, args))
    assert not r.ok and r.content.startswith("error") and expect in r.content, r.content


def test_unknown_builtin_tool_name_is_clear(bwrap_backend, make_sandbox):
    with pytest.raises(ValueError, match="unknown built-in tool"):
        ToolBox(make_sandbox(bwrap_backend), ["bash", "browser"])
