"""The agent worker: an existing agent program, unmodified, as the policy's harness on Harbor
tasks (`env.env = "agent"`).

Per episode: the Harbor task is set up in its sandbox as HarborEnv sets it up (its files in
the work dir, /logs); the env actor has opened the episode's session; the agent program starts
INSIDE the sandbox with the task's instruction, its model calls going to the episode's session
through the session bridge (envs/session_bridge.py, a Unix socket the sandbox sees read-only,
reached through the in-sandbox relay envs/sandbox/relay.py at http://127.0.0.1:PORT/v1), its
commands running where it runs; when it exits or its time budget ends, the bridge closes and
the Harbor verifier runs in the clean room (every process of the sandbox killed, /logs and
/tests refilled). The trajectory is the session's token ledger (forest and picker), never a
re-tokenized transcript of what the agent saw.

Where the agent runs: inside the task's sandbox, not beside it. Beside it (on the host, its
commands sent into the sandbox) would need the agent changed to send its commands there and
would still need a sandbox of its own: on the host it reaches the session server itself (its
sessionless routes, opening sessions, every session whose token it learns), the host's loopback
services and the Ray cluster (GCS and raylet ports on 127.0.0.1 with auth off, the object
store's Unix sockets under /tmp/ray). An
unmodified agent assumes its tools act where it runs: mini-swe-agent runs each command with
`subprocess` in its own process's filesystem, and agents that edit files with Python I/O would
edit the host's. Inside, the sandbox's empty network namespace leaves the bridge as the only way
out, and the bridge forwards only the episode's own session routes with its own token.
Measured with `bench/agent_bridge.py --agent-start` (one run on this 2-core host, load average
~15 from other work; medians of 3 repeats of 200): a model call through relay and bridge took
13.4 ms against 4.7 ms straight to the same instantly answering server (+8.7 ms, where a
generation takes from tens of milliseconds to seconds); a shell command the agent runs itself in
the sandbox 20 ms, against 61 ms through the exec server's channel from beside it (x3.0); the
agent's own start dwarfs both wherever it runs (mini-swe-agent imports LiteLLM: 4.9 CPU s and
201 MB inside, 5.2 CPU s and 203 MB on the host, every episode). The sandbox's memory cap
grows by `memory_mb` for the agent program itself.

Failure classes: the agent exiting 0 is `ok`, past its budget `timeout`, with another status
`error` (a crash); all three are verified and scored. An agent that never got a model answer is
a scored `error` with reward 0 (not verified). Infrastructure (`infra_error`, re-run, never
scored): the sandbox or the task's set-up failing before the agent starts, the launcher unable
to listen, the agent's command missing (exit 126/127 before any model call), and any failure of
the session server under the agent as the bridge saw it. A sandbox that dies while the agent
runs is the model's doing, as in the built-in loop (`error`, reward 0).

Recipe parameters (`env.params`): agent ("mini-swe-agent" | "command"), version (checked
against the installed one), command and args, env (extra variables), modules and mounts (see
envs/agent_programs.py), model (the name the agent is told), timeout_s (the agent's budget;
0 = the task's agent timeout, capped by env.episode_timeout_s), memory_mb, port.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec

from rl360.envs.agent import EpisodeResult, verify_scored
from rl360.envs.agent_programs import agent_program, fill, module_root
from rl360.envs.api import Env, EnvStart, SandboxSpec, TaskRefused
from rl360.envs.harbor import HarborEnv
from rl360.envs.sandbox import Sandbox, SandboxError, SandboxLimits
from rl360.envs.sandbox.relay import LAUNCH_FAILED
from rl360.envs.session_bridge import BridgeStats, SessionBridge, SessionEndpoint, new_bridge_dir
from rl360.envs.verifier import verify_harbor
from rl360.recipe import EnvSection
from rl360.types import Reward, Task

RELAY_SOURCE = (Path(__file__).parent / "sandbox" / "relay.py").read_text()
AGENT_PROCS = 64  # processes + threads the agent program itself may use, on top of the task's
TAIL_CHARS = 2000  # of the agent's output kept in an episode's reason


class AgentWorkerEnv(Env):
    """An agent program on a Harbor task. The env actor runs it with `run_agent_worker`."""

    def __init__(self, agent: str = "command", command: tuple[str, ...] = (),
                 args: tuple[str, ...] = (), version: str = "",
                 env: dict[str, str] | None = None, modules: tuple[str, ...] = (),
                 mounts: tuple[str, ...] = (), model: str = "policy", timeout_s: float = 0.0,
                 memory_mb: int = 1024, port: int = 41641) -> None:
        if timeout_s < 0 or memory_mb < 0 or not 1024 <= port <= 65535:
            raise ValueError("timeout_s and memory_mb must be >= 0 and port in 1024..65535")
        self.program = agent_program(agent, command, args, version, env, modules, mounts)
        self.agent, self.model, self.timeout_s = agent, model, timeout_s
        self.memory_mb, self.port = memory_mb, port
        self.harbor = HarborEnv(system_prompt=None)
        self.bridge_dir = new_bridge_dir()  # made when the bridge starts
        self.task: Task | None = None
        self.sandbox: Sandbox | None = None

    def sandbox_spec(self, task: Task, base: SandboxLimits) -> SandboxSpec:
        if task.kind != "harbor":
            raise TaskRefused(f"the agent worker runs Harbor tasks; task {task.id!r} is of "
                              f"kind {task.kind!r}")
        spec = self.harbor.sandbox_spec(task, base)
        if spec.backends is not None and "bwrap" not in spec.backends:
            raise TaskRefused(f"the agent worker runs in the bwrap sandbox only: {spec.why}")
        lim = spec.limits
        budget = self.timeout_s or float(task.data.get("agent_timeout_sec") or 0)
        # the agent program's own process runs the whole episode (RLIMIT_CPU is per process)
        limits = msgspec.structs.replace(
            lim, cpu_seconds=max(lim.cpu_seconds, math.ceil(budget)),
            memory_mb=lim.memory_mb + self.memory_mb, max_procs=lim.max_procs + AGENT_PROCS)
        binds = [module_root(m) for m in self.program.modules]
        binds = list(dict.fromkeys([*binds, *self.program.mounts, self.bridge_dir]))
        return SandboxSpec(limits=limits, workdir=spec.workdir, scratch_dirs=spec.scratch_dirs,
                           backends=["bwrap"], why=f"the agent worker runs {self.agent} in the "
                           "bwrap sandbox (read-only mounts, the session bridge)",
                           ro_binds=binds)

    async def setup(self, task: Task, sandbox: Sandbox) -> EnvStart:
        self.task, self.sandbox = task, sandbox
        return await self.harbor.setup(task, sandbox)

    async def verify(self) -> Reward:
        """The Harbor verifier (clean room, clean start, bounded reward), as for HarborEnv."""
        assert self.sandbox is not None and self.task is not None, "setup() first"
        return await verify_harbor(self.sandbox, self.task, self.verify_limit_s)

    async def close(self) -> None:
        await self.harbor.close()
        with contextlib.suppress(OSError):  # the bridge removes it; not while a sandbox binds it
            shutil.rmtree(self.bridge_dir)

    def launch(self, sandbox: Sandbox, endpoint: SessionEndpoint,
               socket_path: str) -> tuple[list[str], dict[str, str]]:
        """(argv, env) of the exec that starts the relay and, under it, the agent."""
        assert self.task is not None, "setup() first"
        python = getattr(getattr(sandbox, "python", None), "executable", None) or "python3"
        base_url = f"http://127.0.0.1:{self.port}/v1"
        values = {"python": python, "instruction": self.task.prompt,
                  "workdir": sandbox.workdir, "model": self.model, "base_url": base_url}
        argv = [fill(a, values) for a in self.program.argv]
        roots = [module_root(m) for m in self.program.modules]
        env = {
            "OPENAI_BASE_URL": base_url, "OPENAI_API_BASE": base_url,
            "OPENAI_API_KEY": endpoint.token, "RL360_MODEL": self.model,
            "RL360_INSTRUCTION": self.task.prompt, "PYTHONNOUSERSITE": "1",
            **({"PYTHONPATH": ":".join(dict.fromkeys(roots))} if roots else {}),
            **{k: fill(v, values) for k, v in self.program.env.items()},
        }
        relay = [python, "-I", "-S", "-c", RELAY_SOURCE, str(self.port), socket_path, "--"]
        return [*relay, *argv], env


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= TAIL_CHARS else "..." + text[-TAIL_CHARS:]


async def run_agent_worker(env: AgentWorkerEnv, task: Task, sandbox: Sandbox,
                           endpoint: SessionEndpoint, sampling: dict[str, Any] | None = None,
                           cfg: EnvSection | None = None) -> EpisodeResult:
    """One episode of an agent program (see the module docstring); the caller owns `sandbox`
    and the session."""
    cfg = cfg or EnvSection()
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    counters: dict[str, int] = {}

    def done(status: Any, reason: str, reward: Reward | None = None) -> EpisodeResult:
        timings["total_s"] = time.monotonic() - t0
        return EpisodeResult(status, reward, reason, counters=dict(counters),
                             timings=dict(timings))

    # the bridge's directory is one of the sandbox's mounts: it must exist before the start
    bridge = SessionBridge(endpoint, sampling, cfg.call_timeout_s, directory=env.bridge_dir)
    try:
        try:
            await bridge.start()
            await sandbox.start()
            timings["sandbox_start_s"] = time.monotonic() - t0
            for name in sandbox.protections.missing():
                counters[f"sandbox_missing_{name}"] = 1
            start = await asyncio.wait_for(env.setup(task, sandbox), cfg.call_timeout_s)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            return done("infra_error", f"env setup exceeded {cfg.call_timeout_s:g}s")
        except Exception as e:
            return done("infra_error", f"setup failed: {_why(e)}")
        timings["setup_s"] = time.monotonic() - t0
        budget = min(cfg.episode_timeout_s, start.agent_timeout_s or math.inf,
                     env.timeout_s or math.inf)
        t_agent = time.monotonic()
        try:
            argv, agent_env = env.launch(sandbox, endpoint, bridge.socket_path)
            res = await sandbox.exec(argv, timeout=budget, env=agent_env)
        except asyncio.CancelledError:
            raise
        except SandboxError as e:
            if bridge.stats.infra:
                return done("infra_error", _infra_reason(bridge.stats))
            return done("error", f"sandbox died while the agent ran: {_why(e)}",
                        Reward(value=0.0, components={"sandbox_died": 1.0}))
        except Exception as e:
            return done("infra_error", f"agent launch failed: {_why(e)}")
        finally:
            timings["rollout_s"] = time.monotonic() - t_agent
    finally:
        await bridge.close()  # before the verifier: nothing of the agent's reaches the policy
    stats = bridge.stats
    counters.update(agent_model_calls=stats.model_calls, agent_requests=stats.requests,
                    agent_refused_requests=stats.refused, agent_client_errors=stats.client_errors)
    out = _tail(res.stdout + "\n" + res.stderr)
    if stats.infra:
        return done("infra_error", _infra_reason(stats))
    if res.exit_code == LAUNCH_FAILED and "rl360-relay:" in res.stderr:
        return done("infra_error", f"agent launcher failed: {_tail(res.stderr)}")
    if stats.model_calls == 0:
        if res.exit_code in (126, 127) and not res.timed_out:
            return done("infra_error", f"agent command could not start (exit "
                        f"{res.exit_code}): {out}")
        how = "ran out of time" if res.timed_out else f"exited {res.exit_code}"
        return done("error", f"agent {how} without a model answer: {out}",
                    Reward(value=0.0, components={"agent_no_model_call": 1.0}))
    if res.timed_out:
        status, reason = "timeout", f"agent phase exceeded {budget:g}s"
    elif res.exit_code == 0:
        status, reason = "ok", "agent exited 0"
    else:
        status, reason = "error", f"agent exited {res.exit_code}: {out}"
    t1 = time.monotonic()
    failed, reward = await verify_scored(env, task, start, cfg, counters, acted=True)
    if failed is not None:
        return done(*failed, reward)
    timings["verify_s"] = time.monotonic() - t1
    return done(status, reason, reward)


def _infra_reason(stats: BridgeStats) -> str:
    more = f" (+{len(stats.infra) - 1} more)" if len(stats.infra) > 1 else ""
    return f"session server failed under the agent: {stats.infra[0]}{more}"
