"""Env actors: Ray actors that each host several concurrent episodes with their sandboxes.

An episode opens a session on the session server, runs the agent (the built-in tool loop over
an Env, or a user's agent function), verifies, closes the session and returns the Trajectory
(the built-in loop opens the session with its first chat turn and closes it with its final
one, `SessionShard.turn`: one RPC to the shard per turn):
the ledger's tokens, mask, logprobs and versions, the reward and its components, timings and a
status. A session's ledger is a forest: the trajectory's own tokens are its primary picked leaf
(for the built-in loop, which sends one linear conversation, simply the conversation) and
`branches` the other leaves `serve.picker` chose (an agent function's retries, sub-calls, n>1
choices), each trained with the episode's reward. `EnvActor.run.remote(...)` gives an
ObjectRef[Trajectory]; `rollout.remote(...)` (what the rollout controller calls) gives two
refs, a small EpisodeRecord and the Trajectory, so the controller and the buffer decide on the
record while the tokens stay in the object store until the trainer rank that trains on them
fetches them. Infrastructure failures come back as `infra_error` with the reason, never as
reward 0.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import secrets
import time
from typing import Any

import msgspec
import ray

from rl360.actors.reward_stats import task_domain
from rl360.actors.session_client import (
    FirstTurns,
    SessionDirectory,
    ShardChatClient,
    until_shard_answers,
)
from rl360.envs.agent import run_agent_fn, run_episode
from rl360.envs.agent_worker import AgentWorkerEnv, run_agent_worker
from rl360.envs.api import TaskRefused, open_sandbox
from rl360.envs.registry import build_env_for, env_class, resolve
from rl360.envs.sandbox.pool import GradingPool, PooledSandbox
from rl360.envs.session_bridge import SessionEndpoint
from rl360.policies.affinity import pin_to_cpus
from rl360.recipe import EnvSection, SandboxLimits
from rl360.types import EpisodeRecord, Task, Trajectory

log = logging.getLogger("rl360.env")

# an env actor's calls to its session shard outside a chat turn (open, close: ledger work, no
# generation); a shard that does not answer within this is dead or restarting, and the episode
# fails on the infrastructure (and is re-run). Chat turns are bounded by env.call_timeout_s.
SHARD_CALL_TIMEOUT_S = 120.0


def _infra(task: Task, group_id: str, reason: str, t0: float) -> Trajectory:
    return Trajectory(session_id="", tokens=[], mask=[], logprobs=[], versions=[], provenance=[],
                      task_id=task.id, group_id=group_id, domain=task_domain(task),
                      status="infra_error", error=reason,
                      timings={"episode_s": time.monotonic() - t0})


class _LRU(collections.OrderedDict):  # type: ignore[type-arg]
    """A bounded mapping for the verify cache (oldest entries go first)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def __getitem__(self, key: Any) -> Any:
        self.move_to_end(key)
        return super().__getitem__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        if len(self) > self.size:
            self.popitem(last=False)


class GroupRollout:
    """`rollout_group`: the n episodes of one group in one actor call, over the class's own
    `rollout` (the controller makes one RPC per group instead of one per episode; called with
    `.options(num_returns=n + 1)`, its first return is the list of the n records, one small
    object the controller awaits once, the other n the trajectories, each its own object as
    `rollout`'s). Episodes still run concurrently and each keeps its own session and sandbox;
    an episode that fails fails alone (`run` turns every failure into an infra_error
    trajectory), and the controller re-runs one member with `rollout`."""

    async def rollout_group(self, task: Task, group_id: str, n: int,
                            sampling: dict[str, Any] | None = None) -> tuple[Any, ...]:
        rollout = self.rollout  # type: ignore[attr-defined]
        extra = self._group_args(n)
        pairs = await asyncio.gather(*(rollout(task, group_id, sampling, *extra)
                                       for _ in range(n)))
        return ([p[0] for p in pairs], *(p[1] for p in pairs))

    def _group_args(self, n: int) -> tuple[Any, ...]:
        """Extra arguments `rollout` gets for each member of a group of `n`: none here."""
        return ()


class EnvActor(GroupRollout):
    WARM_SANDBOXES = 8  # per (backend, limits): each serves one grading at a time
    WARM_MAX_USES = 64  # gradings before a warm sandbox is replaced by a fresh one

    def __init__(self, env_cfg: EnvSection, sampling: dict[str, Any], shard_names: list[str],
                 namespace: str, base_url: str, services: dict[str, Any] | None = None) -> None:
        """`env_cfg`: the recipe's [env] section; `sampling`: the default sampling of its
        episodes; the session shards by name (in `namespace`) and the server's base URL;
        `services`: what every env gets as `Env.services` (e.g. the search tool's URL)."""
        pin_to_cpus(env_cfg.cpu_affinity, "env.cpu_affinity")  # sandboxes started later inherit it
        self.cfg = env_cfg
        self.services = dict(services or {})
        self.sampling = dict(sampling)
        self.sessions = SessionDirectory(shard_names, namespace)
        self.base_url = base_url
        self.running = 0
        self.verify_cache = _LRU(50_000)
        self.grading = GradingPool(self.WARM_SANDBOXES, self.WARM_MAX_USES)
        self._tasks: set[asyncio.Task[Any]] = set()  # clean-ups that outlive their episode
        self._sandboxes: set[Any] = set()  # the episodes' sandboxes, until each is closed

    def _background(self, coro: Any, name: str) -> asyncio.Task[Any]:
        """`coro` (one that logs its own failures) as a named task this actor holds until it
        ends."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _sandbox_for(self, env: Any, task: Task, limits: SandboxLimits) -> Any:
        """A view on the warm grading sandboxes (each op exclusive on one, swept after it,
        recycled after N uses or an anomaly) for envs that allow reuse, else a fresh one."""

        def make() -> Any:
            return open_sandbox(env, task, self.cfg.sandbox, limits, self.cfg.allow_unsandboxed)

        if not getattr(env, "reuse_sandbox", False):
            return make()
        spec = env.sandbox_spec(task, limits)
        key = msgspec.json.encode([self.cfg.sandbox, spec]).decode()
        return PooledSandbox(self.grading, key, make)

    def _group_args(self, n: int) -> tuple[Any, ...]:
        # the built-in loop sends a group's first turns together (one shard call, one engine
        # request); an agent function opens its own session over HTTP
        return () if self.cfg.agent_fn or n < 2 else (FirstTurns(n),)

    async def run(self, task: Task, group_id: str = "", sampling: dict[str, Any] | None = None,
                  first_turns: FirstTurns | None = None) -> Trajectory:
        """One episode. `first_turns`: its group's batcher (`rollout_group`), which sends
        this episode's first chat turn together with its siblings'."""
        t0 = time.monotonic()
        self.running += 1
        chat: ShardChatClient | None = None
        sid = self.sessions.session_id(like=first_turns and first_turns.like)
        if first_turns is not None and first_turns.like is None:
            first_turns.like = sid
        # chosen here, so this actor can close the session whatever happens to an answer
        token = secrets.token_urlsafe(24)
        meta = {"task_id": task.id, "group_id": group_id}
        try:
            shard = self.sessions.shard(sid)
            open_s = 0.0  # the built-in loop opens with its first chat turn (SessionShard.turn)
            worker = not self.cfg.agent_fn and runs_agent_program(self.cfg.env, task.kind)
            if self.cfg.agent_fn or worker:  # its agent needs the session before its first call
                try:
                    opened = await asyncio.wait_for(until_shard_answers(
                        lambda: shard.open.remote(meta, None, sid, token)), SHARD_CALL_TIMEOUT_S)
                    open_s = time.monotonic() - t0
                except TimeoutError:
                    return _infra(task, group_id, f"session shard did not open a session "
                                  f"within {SHARD_CALL_TIMEOUT_S:g}s (SHARD_CALL_TIMEOUT_S)", t0)
                except Exception as exc:
                    return _infra(task, group_id, f"session server unreachable: {exc!r}", t0)
                if not isinstance(opened, dict):
                    return _infra(task, group_id, f"could not open a session: {opened}", t0)
            limits = self.cfg.limits
            env = sandbox = None
            closed: Any = None
            try:
                # an agent function needs no env of its own: a plain sandbox, unless the
                # recipe names an env (whose sandbox it then gets)
                if not self.cfg.agent_fn or self.cfg.env:
                    env = build_env_for(self.cfg.env, self.cfg.params, task.kind)
                    env.services = self.services
                sandbox = self._sandbox_for(env, task, limits)
                self._sandboxes.add(sandbox)
                if self.cfg.agent_fn:
                    client = _openai_client(self.base_url, sid, token)
                    result = await run_agent_fn(resolve(self.cfg.agent_fn), task, client, sandbox,
                                                self.cfg)
                elif isinstance(env, AgentWorkerEnv):
                    result = await run_agent_worker(
                        env, task, sandbox, SessionEndpoint(self.base_url, sid, token),
                        sampling or self.sampling, self.cfg)
                else:
                    chat = ShardChatClient(shard, sid, token, sampling or self.sampling,
                                           open_meta=meta, close_final=True,
                                           first_turns=first_turns)
                    result = await run_episode(env, task, sandbox, chat, self.cfg,
                                               verify_cache=self.verify_cache)
                    closed = chat.closed
                    if closed is None and chat.open_meta is not None:
                        # it ended before its first chat turn (a sandbox that did not start,
                        # a setup that failed): no session was opened, so no ledger to read
                        closed = _no_session()
            except (TaskRefused, ValueError) as exc:
                await _safe_close(shard, sid, token)
                return _infra(task, group_id, str(exc), t0)
            except asyncio.CancelledError:
                # tail cancellation (ray.cancel): the chat call in flight was cancelled on the
                # shard (ShardChatClient), so the engine drops the request; close the session
                # now instead of leaving it open until its TTL. Ray repeats a cancel until the
                # task ends, so a second one can end this wait: the close goes on as a task
                # this actor holds (the loop keeps only weak references to tasks)
                await asyncio.shield(self._background(_safe_close(shard, sid, token),
                                                      f"rl360-close-{sid}"))
                raise
            finally:
                t_clean = time.monotonic()
                if sandbox is not None:
                    await _quietly(sandbox.close())
                    self._sandboxes.discard(sandbox)
                if env is not None:
                    await _quietly(env.close())
                cleanup_s = time.monotonic() - t_clean
            t_close = time.monotonic()
            try:  # the picked samples (the final chat turn closed the session already, usually)
                if closed is None:
                    closed = await asyncio.wait_for(shard.close.remote(sid, token, False),
                                                    SHARD_CALL_TIMEOUT_S)
            except TimeoutError:
                return _infra(task, group_id, f"session shard did not return the ledger within "
                              f"{SHARD_CALL_TIMEOUT_S:g}s (SHARD_CALL_TIMEOUT_S)", t0)
            except Exception as exc:  # the shard died with the session's ledger
                return _infra(task, group_id, f"session shard lost: {exc!r}", t0)
            close_s = time.monotonic() - t_close
            if not isinstance(closed, dict):
                return _infra(task, group_id, f"could not read the session ledger: {closed}", t0)
            traj = msgspec.convert(closed, Trajectory)
            traj.reward = result.reward
            traj.status = result.status
            traj.error = None if result.status == "ok" else result.reason
            traj.timings = {**result.timings, "open_s": open_s, "close_s": close_s,
                            "cleanup_s": cleanup_s,
                            "episode_s": time.monotonic() - t0}
            traj.counters = {**traj.counters, **result.counters}
            traj.task_id, traj.group_id = task.id, group_id
            traj.domain = task_domain(task)
            return traj
        finally:
            self.running -= 1
            if first_turns is not None and (chat is None or chat.first_turns is not None):
                first_turns.leave()  # it ended without sending its first turn

    @ray.method(num_returns=2)
    async def rollout(self, task: Task, group_id: str = "",
                      sampling: dict[str, Any] | None = None,
                      first_turns: FirstTurns | None = None) -> tuple[EpisodeRecord, Trajectory]:
        """`run`, returned as (its EpisodeRecord, the Trajectory): two object refs."""
        traj = await self.run(task, group_id, sampling, first_turns)
        return traj.record(), traj

    async def load(self) -> int:
        return self.running

    async def close(self) -> None:
        """Close every sandbox this actor holds, the episodes' still running too: a run that
        stops (its circuit breaker, Ctrl-C, an error) closes its env actors before killing
        them, and a sandbox closed here has every process of it reaped, none left to the host's
        init (a killed actor's sandboxes die with it but are reaped by that init)."""
        open_now, self._sandboxes = list(self._sandboxes), set()
        await asyncio.gather(*(_quietly(sb.close()) for sb in open_now))
        await _quietly(self.grading.close())


def runs_agent_program(env: str, kind: str) -> bool:
    """Whether the env for a task of `kind` runs an agent program (which opens its session
    before it starts); False for a name that resolves to no env (the episode then fails)."""
    try:
        return issubclass(env_class(env or kind), AgentWorkerEnv)
    except ValueError:
        return False


def _no_session() -> dict[str, Any]:
    """The ledger of an episode that never opened its session: no tokens."""
    return msgspec.to_builtins(Trajectory(session_id="", tokens=[], mask=[], logprobs=[],
                                          versions=[], provenance=[]))


async def _quietly(coro: Any) -> None:
    try:
        await coro
    except Exception as exc:  # cleanup must not turn a scored episode into a failure
        log.warning("cleanup failed: %r", exc)


def cancel_episodes(refs: Any) -> int:
    """Cancel the env-actor tasks behind `refs` (an episode's or a group's returns), once per
    task and not recursively: the episode cancels its own shard call (ShardChatClient) and then
    closes its session, and a recursive cancel would cancel that close too (Ray repeats a
    cancel until the task ends, so it reaches calls made after the first one). Returns how
    many tasks were cancelled."""
    seen: set[Any] = set()
    for r in refs:
        tid = r.task_id()
        if tid not in seen:
            seen.add(tid)
            ray.cancel(r, recursive=False)
    return len(seen)


async def _safe_close(shard: Any, sid: str, token: str, tries: int = 3) -> None:
    """Close a cancelled episode's session. A close cancelled by someone's recursive
    `ray.cancel` of the episode is sent again (Ray stops repeating that cancel once the
    episode's task has ended)."""
    for attempt in range(tries):
        try:
            await asyncio.wait_for(shard.close.remote(sid, token), SHARD_CALL_TIMEOUT_S)
            return
        except ray.exceptions.TaskCancelledError as exc:
            if attempt + 1 == tries:
                log.warning("closing session %s was cancelled %d times: %r", sid, tries, exc)
            else:
                await asyncio.sleep(0.5 * (attempt + 1))
        except Exception as exc:
            log.warning("closing session %s failed: %r", sid, exc)
            return


def _openai_client(base_url: str, sid: str, token: str) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{base_url}/sessions/{sid}/v1", api_key=token, max_retries=0)


def with_plain_asyncio(options: dict[str, Any]) -> dict[str, Any]:
    """Actor options whose worker runs the standard asyncio loop instead of uvloop. Env actors
    start sandboxes (subprocesses) from their event loop; uvloop forks through libuv and runs
    Python's after-fork hook in the child (MagicStack/uvloop#749), which waits for a lock
    another thread may hold at fork time: the child never execs and the actor's event loop,
    blocked reading the spawn's error pipe, freezes with every episode on it (seen once in
    ~30k demo episodes; gdb: PyOS_AfterFork_Child -> _PyThreadState_DeleteExcept). Plain
    asyncio spawns through _posixsubprocess, which runs no Python in the child."""
    runtime_env = dict(options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), "RAY_USE_UVLOOP": "0"}
    return {**options, "runtime_env": runtime_env}


class EnvPool:
    """Driver-side handle on N EnvActors; `submit` returns an ObjectRef[Trajectory]."""

    def __init__(self, env: EnvSection, sampling: dict[str, Any], shard_names: list[str],
                 namespace: str, base_url: str, actor_options: dict[str, Any] | None = None,
                 services: dict[str, Any] | None = None) -> None:
        """`env.actors` EnvActors named rl360-env-<i> in `namespace`, each with the Ray
        `actor_options` the assembler chose (resources, node role; default `env.num_cpus`)
        and the stack's `services` for its envs ({"search": {"url", "timeout_s",
        "default_k"}} when the search app runs)."""
        options = with_plain_asyncio(actor_options or {"num_cpus": env.num_cpus})
        cls = ray.remote(EnvActor)
        self.actors = [
            # a dead env actor is restarted (it holds no state a restart needs); its episodes
            # in flight fail and the controller re-runs them on another actor
            cls.options(name=f"rl360-env-{i}", namespace=namespace,
                        max_concurrency=env.episodes_per_actor, get_if_exists=True,
                        max_restarts=-1, max_task_retries=0, **options)
            .remote(env, sampling, shard_names, namespace, base_url, services)
            for i in range(env.actors)
        ]
        self._rr = itertools.cycle(range(len(self.actors)))

    def submit(self, task: Task, group_id: str = "", sampling: dict[str, Any] | None = None) -> Any:
        return self.actors[next(self._rr)].run.remote(task, group_id, sampling)

    def shutdown(self) -> None:
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=30)
        except Exception as exc:  # the actors go anyway
            log.warning("env actors did not close cleanly: %r", exc)
        for a in self.actors:
            ray.kill(a)
