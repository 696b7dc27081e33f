"""`env.params`: the env's constructor parameters from the recipe, checked against the
constructor at recipe check / start with a one-line error naming the bad key, and used by the
built-in envs (reward and its parameters, format penalty, tools, system prompt)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rl360.cli import main
from rl360.envs.code import CodeEnv
from rl360.envs.harbor import HarborEnv
from rl360.envs.registry import build_env_for, check_env_params
from rl360.envs.toolenv import ToolEnv
from rl360.launch.stack import check_recipe_parts
from rl360.recipe import RecipeError, apply_overrides, decode_recipe
from rl360.types import Message, Reward


@pytest.mark.parametrize("env, params, error", [
    ("code", {"reward_fn": "x"}, "env.params.reward_fn: env 'code' (rl360.envs.code:CodeEnv) has no parameter 'reward_fn'; it takes: tools,"),
    ("code", {"tools": "yes"}, "env.params.tools: Expected `bool`, got `str`"),
    ("code", {"reward": "nope"}, "env.params: env 'code' rejects its parameters: unknown reward 'nope'"),
    ("code", {"format_penalty": -1}, "format_penalty must be >= 0"),
    ("tools", {"tools": ["bash", "ls"]}, "unknown tool(s) ['ls']"),
    ("harbor", {"max_output_chars": "many"}, "env.params.max_output_chars: Expected `int`"),
    ("", {"code": {"bogus": 1}}, "env.params.code.bogus: env 'code'"),
    ("", {"tools": True}, "env.params.tools: with env.env = \"\""),
    ("", {"nosuch": {}}, "env.params.nosuch: no built-in env 'nosuch'"),
])
def test_bad_params_name_the_key(env: str, params: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError) as exc:
        check_env_params(env, params)
    assert error in str(exc.value) and "\n" not in str(exc.value)


def test_good_params_pass_and_reach_the_constructor() -> None:
    check_env_params("code", {"tools": True, "reward": "all_pass", "format_penalty": 0.3,
                              "system_prompt": "Be brief."})
    env = build_env_for("code", {"tools": True, "system_prompt": "Be brief.",
                                 "python_flags": ["-I"]}, "code")
    assert isinstance(env, CodeEnv) and env.use_tools and env.system_prompt == "Be brief."
    assert env.python_flags == ["-I"]
    # env.env = "": one table per kind; a kind without a table gets the defaults
    per_kind = {"code": {"reward": "all_pass"}, "harbor": {"format_penalty": 0.5}}
    check_env_params("", per_kind)
    assert isinstance(build_env_for("", per_kind, "harbor"), HarborEnv)
    assert build_env_for("", per_kind, "harbor").format_penalty is not None  # type: ignore[attr-defined]
    assert isinstance(build_env_for("", per_kind, "tools"), ToolEnv)
    tools = build_env_for("tools", {"tools": ["bash", "search"]}, "tools")
    assert tools.tool_names == ("bash", "search")  # type: ignore[attr-defined]


async def test_code_env_reward_and_format_penalty_from_params() -> None:
    from rl360.types import Task

    env = build_env_for("code", {"reward": "all_pass", "format_penalty": 0.3}, "code")
    env.task = Task(id="t", prompt="p", data={"tests": ["assert f() == 1"]})  # type: ignore[attr-defined]
    env.counters = {"malformed_tool_calls": 0}
    r: Reward = await env.grade("no code here")  # type: ignore[attr-defined]
    assert r.value == pytest.approx(-0.3)  # all_pass 0 + format penalty -0.3
    assert r.components["format_penalty"] == pytest.approx(-0.3)


async def test_tool_env_system_prompt_and_exact_match() -> None:
    from types import SimpleNamespace

    from rl360.envs.sandbox import SandboxLimits
    from rl360.types import Task

    env = build_env_for("tools", {"system_prompt": "Use tools.", "tools": ["bash"],
                                  "format_penalty": 0.2}, "tools")
    start = await env.setup(Task(id="t", prompt="q?", kind="tools", data={"answer": "KeyError"}),
                            SimpleNamespace(limits=SandboxLimits(), write_file=None))  # type: ignore[arg-type]
    assert start.messages[0].content == "Use tools." and [t.function.name for t in start.tools] == ["bash"]
    env.transcript = [Message(role="assistant", content=" keyerror. ")]
    env.counters = {}
    assert (await env.verify()).value == 1.0  # normalized exact match
    env.transcript = [Message(role="assistant", content="", tool_calls=[])]
    env.transcript[-1].tool_calls = None
    env.transcript.append(Message(role="tool", content="x"))  # ended without a final answer
    assert (await env.verify()).value == pytest.approx(-0.2)


def test_recipe_check_and_start_report_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('[env]\nenv = "code"\n[env.params]\nreward = "tests_passed"\nsystem_promt = "x"\n')
    assert main(["recipe", "check", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rl360: recipe error: ") and "env.params.system_promt" in err
    assert "\n" not in err
    bad = decode_recipe(apply_overrides({}, ["env.env='tools'", "env.params.reward='nope'"]))
    with pytest.raises(RecipeError, match=r"env\.params: env 'tools' rejects its parameters"):
        check_recipe_parts(bad)  # what running_stack does before Ray starts
    ok = decode_recipe(apply_overrides({}, ["env.env='tools'", "env.params.reward='exact_answer'"]))
    check_recipe_parts(ok)
    missing = decode_recipe(apply_overrides({}, ["search.index='/nonexistent'"]))
    with pytest.raises(RecipeError, match=r"search\.index: '/nonexistent' is not a search index"):
        check_recipe_parts(missing)
