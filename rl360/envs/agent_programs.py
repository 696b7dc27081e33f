"""Agent programs the agent worker runs, unmodified: a preset per known agent, or a command.

An `AgentProgram` is what starts one agent for one episode: its argv, its environment, the
Python packages it imports from this host's environment (their install dirs are mounted
read-only in the sandbox and put on PYTHONPATH) and other host paths it needs to see
(read-only). Strings in argv, args and env may name:

    {python}       the sandbox's Python interpreter
    {instruction}  the task's instruction (also in $RL360_INSTRUCTION)
    {workdir}      the task's work dir, where the agent starts
    {model}        the model name the agent is told (env.params.model)
    {base_url}     http://127.0.0.1:{port}/v1, the episode's session (also $OPENAI_BASE_URL)

Every agent gets OPENAI_BASE_URL and OPENAI_API_BASE (the OpenAI SDK and LiteLLM read them),
OPENAI_API_KEY (the episode's session token), RL360_MODEL and RL360_INSTRUCTION.

Presets:
  mini-swe-agent  its `mini` command (`python -m minisweagent.run.mini`) with the default agent
                  class, the local environment (its commands run as subprocesses in the work
                  dir, i.e. in the sandbox), its own mini.yaml, `openai/{model}` through
                  LiteLLM, no cost limit (the policy has no price), one try per model call
                  (the bridge reports an infrastructure failure; a retry would hide it), and
                  its files under /tmp. Extra `-c key=value` settings go in `args`, e.g.
                  ["-c", "agent.step_limit=8"].
  command         `command` as given, e.g. ["{python}", "agents/agent.py", "--model", "{model}"]
                  with mounts = ["agents"]. A relative path to a file inside a mount is made
                  absolute (recipe paths are relative to where rl360 runs).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Callable, Sequence

import msgspec

MINI_SWE_AGENT = "mini-swe-agent"


class AgentProgram(msgspec.Struct, frozen=True):
    argv: list[str]
    env: dict[str, str] = msgspec.field(default_factory=dict)
    modules: list[str] = msgspec.field(default_factory=list)  # Python packages it imports
    mounts: list[str] = msgspec.field(default_factory=list)  # host paths it must see (read-only)


def module_root(name: str) -> str:
    """The sys.path entry `name` is imported from (e.g. a site-packages dir); ValueError naming
    the module when it is not installed here."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"agent module {name!r} is not importable here: {exc}") from None
    if spec is None or (spec.origin is None and not spec.submodule_search_locations):
        raise ValueError(f"agent module {name!r} is not installed in this environment")
    if spec.submodule_search_locations:  # a package: the dir above the package's own
        where = os.path.dirname(os.path.realpath(next(iter(spec.submodule_search_locations))))
    else:
        where = os.path.dirname(os.path.realpath(spec.origin or ""))
    for _ in range(name.count(".")):
        where = os.path.dirname(where)
    return where


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _mini_swe_agent(command: Sequence[str], args: Sequence[str], version: str) -> AgentProgram:
    have = installed_version(MINI_SWE_AGENT)
    if have is None:
        raise ValueError("agent 'mini-swe-agent' is not installed (pip install -e '.[agents]', "
                         "which `make venv` does)")
    if version and have != version:
        raise ValueError(f"agent 'mini-swe-agent': the recipe asks for version {version}, "
                         f"{have} is installed")
    if command:
        raise ValueError("agent 'mini-swe-agent' builds its own command; put extra options "
                         "in env.params.args")
    config = os.path.join(module_root("minisweagent"), "minisweagent", "config", "mini.yaml")
    argv = ["{python}", "-m", "minisweagent.run.mini", "--agent-class", "default",
            "--environment-class", "local", "-m", "openai/{model}", "-t", "{instruction}",
            "--yolo", "--exit-immediately", "--cost-limit", "0", "-c", config,
            "-c", "environment.cwd={workdir}", "-o", "/tmp/mini-swe-agent/trajectory.json",
            *args]
    env = {
        "MSWEA_CONFIGURED": "true",  # no first-run set-up dialogue
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_GLOBAL_CONFIG_DIR": "/tmp/mini-swe-agent",  # not in the work dir
        "MSWEA_COST_TRACKING": "ignore_errors",  # the policy is no priced model
        "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no download (the sandbox has no network)
    }
    return AgentProgram(argv=argv, env=env, modules=["minisweagent"])


def _command(command: Sequence[str], args: Sequence[str], version: str) -> AgentProgram:
    if not command:
        raise ValueError("agent 'command' needs env.params.command, e.g. "
                         "[\"{python}\", \"/path/agent.py\"]")
    return AgentProgram(argv=[*command, *args])


PRESETS: dict[str, Callable[[Sequence[str], Sequence[str], str], AgentProgram]] = {
    MINI_SWE_AGENT: _mini_swe_agent,
    "command": _command,
}


def agent_program(agent: str, command: Sequence[str] = (), args: Sequence[str] = (),
                  version: str = "", env: dict[str, str] | None = None,
                  modules: Sequence[str] = (), mounts: Sequence[str] = ()) -> AgentProgram:
    """The program for `agent` (a preset name) with the recipe's additions; ValueError naming
    the problem (unknown agent, not installed, wrong version, a module or path missing)."""
    if agent not in PRESETS:
        raise ValueError(f"unknown agent {agent!r}; known: {sorted(PRESETS)}")
    base = PRESETS[agent](command, args, version)
    for m in modules:
        module_root(m)
    paths = [os.path.abspath(p) for p in mounts]
    for p in paths:
        if not os.path.exists(p):
            raise ValueError(f"agent mount {p!r} does not exist")
    argv = [_inside(a, paths) for a in base.argv]
    return AgentProgram(argv=argv, env={**base.env, **(env or {})},
                        modules=[*base.modules, *modules], mounts=paths)


def _inside(arg: str, mounts: list[str]) -> str:
    """`arg` made absolute when it is a relative path to a file inside one of the mounts (a
    recipe's paths are relative to where rl360 runs; the agent starts in the task's work dir)."""
    if os.path.isabs(arg) or not os.path.isfile(arg):
        return arg
    full = os.path.abspath(arg)
    return full if any(full.startswith(m.rstrip("/") + "/") for m in mounts) else arg


PLACEHOLDER = re.compile(r"\{(python|instruction|workdir|model|base_url)\}")


def fill(text: str, values: dict[str, str]) -> str:
    """`text` with its {name} placeholders filled in one pass (a value is never read as a
    placeholder again); other braces are left as they are."""
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], text)
