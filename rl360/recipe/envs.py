"""Recipe sections of the environments: [env] with [env.limits] (one sandbox's caps) and
[eval].
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rl360.recipe.base import NonNegFloat, NonNegInt, PosInt, Section
from rl360.recipe.serving import SamplingSection


class SandboxLimits(Section):
    """[env.limits]: caps for one sandbox (tasks may ask for other values). Memory covers every process of the sandbox together with the files
    it keeps in its RAM-backed work dir and /tmp (where the backend stores them in RAM)."""

    cpu_seconds: int = 30  # CPU time per exec'd process (RLIMIT_CPU)
    memory_mb: int = 512  # whole sandbox (cgroup) or per process (rlimit), see protections
    max_procs: int = 64  # processes + threads of the sandbox at once
    disk_mb: int = 256  # size of the writable work dir
    tmp_mb: int = 64  # size of the private /tmp
    output_bytes: int = 65536  # kept per stream per exec (head and tail); the rest is dropped
    timeout: float = 30.0  # default wall-clock timeout of one exec, seconds
    network: bool = False
    cpus: float | None = None  # CPU bandwidth (cgroup cpu controller) where available
    # scheduling niceness of everything in the sandbox: model-written code yields the CPU to
    # the engines and trainers of the same host (a burst of gradings must not starve them)
    nice: int = 10

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_mb", "max_procs", "disk_mb", "tmp_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.output_bytes < 0 or self.timeout <= 0:
            raise ValueError("SandboxLimits.output_bytes must be >= 0 and timeout > 0")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"SandboxLimits.nice must be in 0..19, got {self.nice}")


class EnvSection(Section):
    sandbox: Literal["auto", "bwrap", "process", "docker"] = "auto"
    actors: PosInt = 1  # env actors; each hosts several concurrent episodes
    episodes_per_actor: PosInt = 32
    num_cpus: NonNegFloat = 0.0
    env: str = ""  # "" = by task kind (code, harbor); else a name or "package.module:Class"
    # the env's constructor parameters (reward, reward_params, format_penalty, tools,
    # system_prompt, ...): with `env` set, this table; with env = "", one table per task kind
    # ([env.params.code], [env.params.harbor]). Checked against the constructor at start.
    params: dict[str, Any] = msgspec.field(default_factory=dict)
    agent_fn: str = ""  # "package.module:run": an agent function instead of the built-in loop
    max_turns: PosInt = 8
    call_timeout_s: Annotated[float, Meta(gt=0.0)] = 300.0  # one chat call; beyond: infra error
    # the agent phase of an episode (setup to final answer)
    episode_timeout_s: Annotated[float, Meta(gt=0.0)] = 900.0
    verify_timeout_s: Annotated[float, Meta(gt=0.0)] = 900.0
    max_consecutive_tool_failures: PosInt = 3
    max_tool_output_chars: PosInt = 8000  # a tool result longer than this is cut for the model
    limits: SandboxLimits = msgspec.field(default_factory=SandboxLimits)
    # "auto" means bwrap or a clear failure; true lets "auto" fall back to the process backend
    # (host user, host network and filesystem: no isolation at all) where bwrap cannot run
    allow_unsandboxed: bool = False
    # pin every env actor's threads, and so the sandboxes and graders they start, to these CPU
    # cores (Linux); [] = no pinning. With engine/trainer.cpu_affinity: keeps the rollout side
    # (agent loops, grading) off the trainer's cores, or emulates separate machines on one host
    cpu_affinity: list[Annotated[int, Meta(ge=0, le=65535)]] = msgspec.field(default_factory=list)


class EvalSection(Section):
    tasks: list[str] = msgspec.field(default_factory=lambda: ["examples/tasks"])
    attempts: PosInt = 8
    concurrency: PosInt = 16
    limit: NonNegInt = 0  # 0 = all tasks
    per_domain: NonNegInt = 0  # > 0: the first this many tasks of each domain (family)
    out: str = ""  # default: <run.out_dir>/<run.name>/eval.jsonl
    # `rl360 eval --calibrate` keeps the tasks whose pass rate over `attempts` attempts lies in
    # [band_low, band_high] and writes their full records (usable as train.tasks)
    band_low: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.2
    band_high: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.4
    calibrated_out: str = ""  # default: <run.out_dir>/<run.name>/calibrated_tasks.jsonl
    # "task": keep each task whose own pass rate is in the band; "domain": keep every task
    # of `eval.tasks` (per_domain and limit aside) whose domain's pooled pass rate is in the
    # band (few attempts per task cannot place a task, a family's dozens can)
    calibrate_by: Literal["task", "domain"] = "task"
    sampling: SamplingSection = msgspec.field(default_factory=SamplingSection)

    def __post_init__(self) -> None:
        if self.band_low > self.band_high:
            raise ValueError(f"band_low ({self.band_low}) must be <= band_high ({self.band_high})")
