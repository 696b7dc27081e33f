"""The Env API users subclass, and the sandbox request an env makes for a task.

    class MyEnv(Env):
        async def setup(self, task, sandbox) -> EnvStart:    # first messages + tool specs
        async def step(self, tool_call) -> ToolResult:       # run one tool call
        async def verify(self) -> Reward:                    # score the episode

The agent loop (rl360.envs.agent.run_episode) sets `env.transcript` (the messages so far, the
model's final answer last) and `env.counters` (malformed_tool_calls, tool_calls, tool_failures)
before `setup`, and keeps them current; `verify` reads them. Register an env by name in
rl360.envs.registry or refer to it as "package.module:Class".

An env may raise TaskRefused from `sandbox_spec` or `setup` when a task cannot run on this host
(its reason names the task): the task is skipped up front, never scored.
"""

from __future__ import annotations

import abc
from typing import Any

import msgspec

from rl360.envs.sandbox import Sandbox, SandboxLimits, build_sandbox, unavailable_reason
from rl360.envs.sandbox.factory import UNSANDBOXED_HINT
from rl360.rewards.bounds import RewardRange, task_range
from rl360.types import Message, Reward, Task, ToolCall, ToolSpec


class TaskRefused(ValueError):
    """This task cannot run here (e.g. it needs its own container image and no Docker runs)."""


class ModelFault(RuntimeError):
    """A failure the model caused (its sandbox died during its own command, its work left the
    verifier unable to write a reward): a scored failure (status error, reward 0), never an
    unscored infra_error."""


class EnvStart(msgspec.Struct, omit_defaults=True):
    messages: list[Message]
    tools: list[ToolSpec] = msgspec.field(default_factory=list)
    agent_timeout_s: float | None = None  # the task's own cap on the agent phase
    verify_timeout_s: float | None = None  # the task's own cap on verification


class ToolResult(msgspec.Struct, omit_defaults=True):
    content: str
    ok: bool = True


class SandboxSpec(msgspec.Struct, omit_defaults=True):
    """What sandbox a task needs: its limits and shape, and the backends able to provide it."""

    limits: SandboxLimits
    workdir: str | None = None
    scratch_dirs: list[str] = msgspec.field(default_factory=list)
    backends: list[str] | None = None  # None: any backend
    image: str | None = None  # container image (docker backend)
    build: str | None = None  # a host dir with a Dockerfile: the image, built (docker backend)
    why: str = ""  # why only `backends` will do (for the refusal message)
    ro_binds: list[str] = msgspec.field(default_factory=list)  # host paths seen read-only (bwrap)


class Env(abc.ABC):
    """Base class of environments. Subclasses implement setup / verify and, for tool-using
    envs, step. Instances are per episode."""

    transcript: list[Message]
    counters: dict[str, int]
    # the stack's services, set by the env actor before setup: {"search": {"url", "timeout_s",
    # "default_k"}} when the search app runs (rl360.envs.search_tool.make_toolbox reads it)
    services: dict[str, Any] = {}  # replaced per env by the actor, never mutated

    # True when episodes may share one long-lived sandbox (the env never changes it and verify
    # runs a fresh process per grading); env actors then keep warm sandboxes per backend
    reuse_sandbox: bool = False

    # the verifier's own time limit for this episode, set by the agent loop before verify (the
    # smaller of the recipe's env.verify_timeout_s and the task's own); None: the env's default
    verify_limit_s: float | None = None
    # the most verify() spends beyond verify_limit_s (a clean room made before the verifier)
    verify_overhead_s: float = 5.0

    def reward_range(self, task: Task) -> RewardRange:
        """The range this env's reward lies in for `task`: the task's declared range (default
        [0, 1]), widened below by any penalty the env subtracts. The agent loop clamps to it."""
        return task_range(task)

    def verify_key(self) -> str | None:
        """A key such that equal keys give equal rewards (verify is a pure function of the
        task and the transcript), or None. Env actors cache rewards by it, so identical
        completions of one task are executed once."""
        return None

    def sandbox_spec(self, task: Task, base: SandboxLimits) -> SandboxSpec:
        """The sandbox this task needs; the default is `base` on any backend."""
        return SandboxSpec(limits=base)

    @abc.abstractmethod
    async def setup(self, task: Task, sandbox: Sandbox) -> EnvStart:
        """Prepare the sandbox for `task`; return the first messages and the tool specs."""

    async def step(self, tool_call: ToolCall) -> ToolResult:
        """Run one tool call. The default has no tools."""
        return ToolResult(
            f"error: this environment has no tool {tool_call.function.name!r}", ok=False
        )

    @abc.abstractmethod
    async def verify(self) -> Reward:
        """Score the episode (self.transcript holds it). Raise only for a broken verifier."""

    async def close(self) -> None:
        """Release what setup took (the sandbox is closed by its owner)."""
        return None

    # ----------------------------------------------------------------- helpers for subclasses

    def final_message(self) -> Message | None:
        """The model's final answer: the last message when it is an assistant message without
        tool calls, else None (the episode ended some other way)."""
        msgs = getattr(self, "transcript", None) or []
        if msgs and msgs[-1].role == "assistant" and not msgs[-1].tool_calls:
            return msgs[-1]
        return None

    @property
    def final_answer(self) -> str | None:
        msg = self.final_message()
        return None if msg is None else (msg.content or "")

    def counter(self, name: str) -> int:
        return int((getattr(self, "counters", None) or {}).get(name, 0))


def choose_backend(
    spec: SandboxSpec, backend: str, task: Task, allow_unsandboxed: bool = False
) -> str:
    """The backend to run `task` on: `backend` if it can, or for "auto" the first one of the
    spec's backends (default bwrap, then process only with allow_unsandboxed) that works here.
    Raises TaskRefused naming the task."""
    allowed = spec.backends or ["bwrap", "process"]
    if backend != "auto":
        if spec.backends is not None and backend not in spec.backends:
            raise TaskRefused(
                f"task {task.id!r} cannot run on the {backend} sandbox: {spec.why or 'needs ' + '/'.join(allowed)}"
            )
        why = unavailable_reason(backend)
        if why is not None:
            raise TaskRefused(f"task {task.id!r}: the {backend} sandbox is unavailable here: {why}")
        return backend
    reasons = []
    if not allow_unsandboxed and "process" in allowed:
        allowed = [b for b in allowed if b != "process"]
        reasons.append(f"process: refused ({UNSANDBOXED_HINT})")
    for name in allowed:
        why = unavailable_reason(name)
        if why is None:
            return name
        reasons.append(f"{name}: {why}")
    raise TaskRefused(
        f"task {task.id!r} cannot run here: {spec.why or 'no usable sandbox'} ({'; '.join(reasons)})"
    )


def open_sandbox(
    env: Env | None,
    task: Task,
    backend: str = "auto",
    base: SandboxLimits | None = None,
    allow_unsandboxed: bool = False,
) -> Sandbox:
    """Build (unstarted) the sandbox `env` asks for `task`, refusing up front what cannot run;
    without an env (an agent function's episode) a plain one with the `base` limits."""
    base = base or SandboxLimits()
    spec = env.sandbox_spec(task, base) if env is not None else SandboxSpec(limits=base)
    name = choose_backend(spec, backend, task, allow_unsandboxed)
    options: dict[str, Any] = {}
    if spec.ro_binds:
        if name != "bwrap":
            raise TaskRefused(f"task {task.id!r} needs host paths mounted read-only, which "
                              f"only the bwrap sandbox gives (not {name})")
        options["ro_binds"] = spec.ro_binds
    if spec.scratch_dirs:
        if name == "process":
            raise TaskRefused(
                f"task {task.id!r} needs private dirs {spec.scratch_dirs} the process sandbox cannot give"
            )
        options["scratch_dirs"] = spec.scratch_dirs
    if spec.image and name == "docker":
        options["image"] = spec.image
    if spec.build and name == "docker":
        options["build_context"] = spec.build
    workdir = spec.workdir if name != "process" else None
    return build_sandbox(name, spec.limits, workdir, **options)
