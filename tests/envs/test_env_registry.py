"""Env registry: built-in names and "package.module:Class" strings."""

from __future__ import annotations

import pytest

from rl360.envs.agent_worker import AgentWorkerEnv
from rl360.envs.code import CodeEnv
from rl360.envs.harbor import HarborEnv
from rl360.envs.registry import BUILTIN_ENVS, build_env, env_class, resolve
from rl360.envs.toolenv import ToolEnv


def test_builtin_names():
    assert set(BUILTIN_ENVS) == {"code", "harbor", "tools", "synthetic", "agent"}
    assert env_class("code") is CodeEnv and env_class("harbor") is HarborEnv
    assert env_class("agent") is AgentWorkerEnv
    assert isinstance(build_env("tools"), ToolEnv)
    env = build_env("rl360.envs.code:CodeEnv", tools=True)
    assert isinstance(env, CodeEnv) and env.use_tools


def test_resolve_errors_name_the_string():
    assert resolve("rl360.envs.code:CodeEnv.grade") is CodeEnv.grade
    with pytest.raises(ValueError, match=r"'no_such_pkg.mod:X'.*not importable"):
        resolve("no_such_pkg.mod:X")
    with pytest.raises(ValueError, match=r"'rl360.envs.code:Nope'.*no attribute 'Nope'"):
        resolve("rl360.envs.code:Nope")
    with pytest.raises(ValueError, match=r"expected 'package.module:Attr'"):
        resolve("rl360.envs.code")
    with pytest.raises(ValueError, match="unknown env 'mystery'"):
        env_class("mystery")
    with pytest.raises(ValueError, match=r"not a subclass of rl360.envs.api.Env"):
        env_class("rl360.envs.code:extract_code")
    with pytest.raises(ValueError, match="bad parameters for env 'code'"):
        build_env("code", colour="blue")
