"""The built-in tool-calling agent loop, and the agent-function form.

Final-answer convention: the episode ends when the model sends an assistant message WITHOUT
tool calls; that message is the final answer (`Env.final_answer`). A reply whose tool calls
could not be parsed counts its malformed calls and, having no valid call, is the final answer
too (the format penalty can grade it). Otherwise each tool call runs through `env.step` and its
result goes back as a "tool" message.

Statuses: ok (final answer), truncated (max turns, or the final answer hit the token limit),
timeout (the episode's wall-clock budget ran out), error (the model's fault: too many
consecutive failing tool calls; the sandbox died during a model-issued command; the verifier
found no reward after the agent ran, `ModelFault`; the verifier overran or its sandbox failed
after the agent ran commands there; a non-finite reward) are all scored (error: reward 0 when
verification is impossible). infra_error (the sandbox could not start, the chat client raised
or hung, the env crashed) is only what the model cannot cause; it carries no reward and must
never be scored as 0.

Rewards are bounded: the env's `reward_range(task)` (the task's declared range, default [0, 1])
clamps the verified reward; a clamp is counted (`reward_clamped`). An agent function's reward is
clamped to the task's range the same way.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, Protocol

import msgspec

from rl360.envs.api import Env, EnvStart, ModelFault
from rl360.envs.sandbox import Sandbox, SandboxError
from rl360.envs.tools import clip
from rl360.recipe import EnvSection
from rl360.rewards.bounds import NonFiniteReward, RewardRange, bound_reward, task_range
from rl360.types import EpisodeStatus, Message, Reward, Task, ToolSpec


class ChatTurn(msgspec.Struct, omit_defaults=True):
    message: Message  # the assistant message (tool_calls parsed, when any)
    finish_reason: str = "stop"  # "stop" | "length" | "tool_calls" | "abort"
    malformed_tool_calls: int = 0  # tool calls in the reply that could not be parsed
    timings: dict[str, float] = msgspec.field(default_factory=dict)  # server-side, summed


class ChatClient(Protocol):
    """One chat turn of the policy. Implementations raise on infrastructure failure (engine
    unreachable, server error); they never raise for what the model wrote."""

    async def chat(self, messages: list[Message], tools: list[ToolSpec]) -> ChatTurn: ...


class EpisodeResult(msgspec.Struct, omit_defaults=True):
    status: EpisodeStatus
    reward: Reward | None = None  # None exactly when status is infra_error (or unscored timeout)
    reason: str = ""
    messages: list[Message] = msgspec.field(default_factory=list)
    turns: int = 0
    counters: dict[str, int] = msgspec.field(default_factory=dict)
    timings: dict[str, float] = msgspec.field(default_factory=dict)


class InfraError(RuntimeError):
    """Raise from a client, tool or verifier to mark a failure as the infrastructure's."""


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def run_episode(
    env: Env,
    task: Task,
    sandbox: Sandbox,
    client: ChatClient,
    cfg: EnvSection | None = None,
    verify_cache: MutableMapping[str, Reward] | None = None,
) -> EpisodeResult:
    """Drive `env` on `task` with `client` until a final answer, max turns, a timeout or too
    many failing tool calls; then verify. The caller owns (and closes) `sandbox`. With a
    `verify_cache`, an env whose `verify_key()` is not None is verified once per key."""
    cfg = cfg or EnvSection()
    t0 = time.monotonic()
    messages: list[Message] = []
    counters = {"tool_calls": 0, "tool_failures": 0, "malformed_tool_calls": 0}
    env.transcript, env.counters = messages, counters
    timings: dict[str, float] = {}
    turns = 0

    def done(status: EpisodeStatus, reason: str, reward: Reward | None = None) -> EpisodeResult:
        timings["total_s"] = time.monotonic() - t0
        return EpisodeResult(status, reward, reason, messages, turns, dict(counters), dict(timings))

    try:
        await sandbox.start()
        timings["sandbox_start_s"] = time.monotonic() - t0
        for name in sandbox.protections.missing():  # into the run's metrics, never silent
            counters[f"sandbox_missing_{name}"] = 1
        start = await asyncio.wait_for(env.setup(task, sandbox), cfg.call_timeout_s)
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        return done("infra_error", f"env setup exceeded {cfg.call_timeout_s:g}s")
    except Exception as e:
        return done("infra_error", f"setup failed: {_why(e)}")
    timings["setup_s"] = time.monotonic() - t0
    messages.extend(start.messages)
    budget = min(cfg.episode_timeout_s, start.agent_timeout_s or math.inf)
    deadline = time.monotonic() + budget
    status: EpisodeStatus = "truncated"
    reason = f"reached max_turns={cfg.max_turns}"
    consecutive = 0
    timings["chat_s"] = timings["tools_s"] = 0.0

    for _ in range(cfg.max_turns):
        remaining = deadline - time.monotonic()
        limit = min(cfg.call_timeout_s, remaining)
        if remaining <= 0:
            status, reason = "timeout", f"agent phase exceeded {budget:g}s"
            break
        t_chat = time.monotonic()
        try:
            turn = await asyncio.wait_for(client.chat(list(messages), start.tools), limit)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            if limit < cfg.call_timeout_s:
                status, reason = "timeout", f"agent phase exceeded {budget:g}s"
                break
            return done("infra_error", f"chat call exceeded {cfg.call_timeout_s:g}s")
        except Exception as e:
            return done("infra_error", f"chat client failed: {_why(e)}")
        turns += 1
        timings["chat_s"] += time.monotonic() - t_chat
        for k, v in turn.timings.items():
            timings[k] = timings.get(k, 0.0) + v
        msg = turn.message
        messages.append(msg)
        counters["malformed_tool_calls"] += turn.malformed_tool_calls
        consecutive += turn.malformed_tool_calls
        if not msg.tool_calls:
            if turn.finish_reason == "length":
                status, reason = "truncated", "final answer cut at the token limit"
            else:
                status, reason = "ok", "final answer"
            break
        timed_out = False
        t_tools = time.monotonic()
        for call in msg.tool_calls:
            counters["tool_calls"] += 1
            try:
                result = await asyncio.wait_for(
                    env.step(call), max(0.0, deadline - time.monotonic())
                )
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                timed_out = True
                break
            except (SandboxError, ModelFault) as e:  # the model's own command broke it
                return done(
                    "error",
                    f"sandbox died during tool {call.function.name!r}: {_why(e)}",
                    Reward(value=0.0, components={"sandbox_died": 1.0}),
                )
            except Exception as e:
                return done("infra_error", f"tool {call.function.name!r} failed: {_why(e)}")
            content = clip(result.content, cfg.max_tool_output_chars)
            messages.append(
                Message(role="tool", content=content, tool_call_id=call.id, name=call.function.name)
            )
            if result.ok:
                consecutive = 0
            else:
                consecutive += 1
                counters["tool_failures"] += 1
        timings["tools_s"] += time.monotonic() - t_tools
        if timed_out:
            status, reason = "timeout", f"agent phase exceeded {budget:g}s"
            break
        if consecutive >= cfg.max_consecutive_tool_failures:
            status, reason = "error", f"{consecutive} consecutive failing tool calls"
            break
    timings["rollout_s"] = time.monotonic() - t0 - timings["setup_s"]

    acted = counters["tool_calls"] > 0
    t1 = time.monotonic()
    failed, reward = await verify_scored(env, task, start, cfg, counters, acted, verify_cache)
    if failed is not None:
        return done(*failed, reward)
    timings["verify_s"] = time.monotonic() - t1
    return done(status, reason, reward)


async def verify_scored(
    env: Env, task: Task, start: EnvStart, cfg: EnvSection, counters: dict[str, int],
    acted: bool, verify_cache: MutableMapping[str, Reward] | None = None,
) -> tuple[tuple[EpisodeStatus, str] | None, Reward | None]:
    """`env.verify()` with every failure class, for any harness that ran an agent (this loop,
    the agent worker): (None, reward bounded to `env.reward_range(task)`) when it verified,
    else ((status, reason), reward or None). `acted`: the agent ran commands in the sandbox, so
    a verifier that overruns or a sandbox that fails during verification may be its doing:
    scored (error, reward 0), never an unscored infra_error."""
    verify_limit = min(cfg.verify_timeout_s, start.verify_timeout_s or math.inf)
    env.verify_limit_s = verify_limit
    key = env.verify_key() if verify_cache is not None else None
    limit = verify_limit + env.verify_overhead_s
    try:
        reward, shared = await _shared_verify(env, verify_cache, key, limit)
        if reward is None:
            reward = await asyncio.wait_for(env.verify(), limit)
        elif shared:
            counters["verify_cached"] = 1
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        why = f"verifier exceeded {verify_limit:g}s"
        if acted:
            return ("error", why), Reward(value=0.0, components={"verifier_overrun": 1.0})
        return ("infra_error", why), None
    except ModelFault as e:
        return ("error", f"verifier: {_why(e)}"), Reward(
            value=0.0, components={"verifier_no_reward": 1.0})
    except SandboxError as e:
        if acted:
            return ("error", f"sandbox failed during verification: {_why(e)}"), Reward(
                value=0.0, components={"sandbox_died": 1.0})
        return ("infra_error", f"verifier failed: {_why(e)}"), None
    except Exception as e:
        return ("infra_error", f"verifier failed: {_why(e)}"), None
    try:
        return None, bounded(reward, env.reward_range(task), counters)
    except NonFiniteReward as e:
        return ("error", f"verifier: {e}"), Reward(value=0.0, components={"non_finite": 1.0})
    except ValueError as e:  # the task's reward_range is malformed
        return ("infra_error", str(e)), None


def bounded(reward: Reward, rng: RewardRange, counters: dict[str, int]) -> Reward:
    """`reward` clamped to `rng` (counted in `counters["reward_clamped"]`, also when the
    verifier clamped it already); NonFiniteReward for NaN or an infinity."""
    reward, clamped = bound_reward(reward, rng)
    if clamped or reward.components.get("reward_clamped"):
        counters["reward_clamped"] = 1
    return reward


async def _shared_verify(env: Env, cache: MutableMapping[str, Any] | None, key: str | None,
                         limit: float) -> tuple[Reward | None, bool]:
    """(reward, shared): the reward of an identical submission (same `verify_key`: same task,
    same final answer text, same malformed-call count) graded before or being graded right
    now (shared), else this episode's own grading as the first with its key, else (None,
    False): the caller grades. Concurrent episodes with one key await the first one's
    sandboxed run; if that fails or is cancelled they get None and grade on their own."""
    if key is None or cache is None:
        return None, False
    if key in cache:
        hit = cache[key]
        if isinstance(hit, Reward):
            return hit, True
        shared = await asyncio.shield(hit)  # another episode's grading of the same submission
        return shared, shared is not None
    fut: asyncio.Future[Reward | None] = asyncio.get_running_loop().create_future()
    cache[key] = fut
    reward: Reward | None = None
    try:
        reward = await asyncio.wait_for(env.verify(), limit)
        return reward, False
    finally:
        fut.set_result(reward)  # None: the waiters grade themselves
        if reward is not None:
            cache[key] = reward
        elif cache.get(key) is fut:
            del cache[key]


# ----------------------------------------------------------------------------- agent functions

AgentFn = Callable[[Task, Any, Sandbox], Awaitable[Reward]]


async def run_agent_fn(
    fn: AgentFn, task: Task, client: Any, sandbox: Sandbox, cfg: EnvSection | None = None
) -> EpisodeResult:
    """Run a user's `async run(task, client, sandbox) -> Reward` (any OpenAI-compatible agent;
    its tokens come from the session server's ledger). A timeout is unscored (reward None); an
    exception from the agent function or its client is an infra_error."""
    cfg = cfg or EnvSection()
    t0 = time.monotonic()
    try:
        await sandbox.start()
    except Exception as e:
        return EpisodeResult("infra_error", reason=f"sandbox failed to start: {_why(e)}")
    try:
        reward = await asyncio.wait_for(fn(task, client, sandbox), cfg.episode_timeout_s)
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        return EpisodeResult(
            "timeout",
            reason=f"agent function exceeded {cfg.episode_timeout_s:g}s",
            timings={"total_s": time.monotonic() - t0},
        )
    except Exception as e:
        return EpisodeResult(
            "infra_error",
            reason=f"agent function failed: {_why(e)}",
            timings={"total_s": time.monotonic() - t0},
        )
    if not isinstance(reward, Reward):
        return EpisodeResult(
            "infra_error", reason=f"agent function returned {type(reward).__name__}, not a Reward"
        )
    counters: dict[str, int] = {}
    timings = {"total_s": time.monotonic() - t0}
    try:
        reward = bounded(reward, task_range(task), counters)
    except NonFiniteReward as e:
        return EpisodeResult("error", Reward(value=0.0, components={"non_finite": 1.0}),
                             f"agent function: {e}", timings=timings)
    except ValueError as e:
        return EpisodeResult("infra_error", reason=str(e), timings=timings)
    return EpisodeResult("ok", reward, "agent function returned", counters=counters,
                         timings=timings)


# ----------------------------------------------------------------------------- test double


class ScriptedClient:
    """A ChatClient that replays canned replies: each item is a Message (an assistant reply), a
    ChatTurn, an Exception (raised), or a callable (messages, tools) -> one of those. Records
    the messages of every call in `calls`."""

    def __init__(self, script: Sequence[Any], delay_s: float = 0.0) -> None:
        self.script = list(script)
        self.calls: list[list[Message]] = []
        self.delay_s = delay_s

    async def chat(self, messages: list[Message], tools: list[ToolSpec]) -> ChatTurn:
        self.calls.append(list(messages))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if not self.script:
            raise InfraError("scripted client ran out of replies")
        item = self.script.pop(0)
        if callable(item) and not isinstance(item, Message | ChatTurn):
            item = item(messages, tools)
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, Message):
            finish = "tool_calls" if item.tool_calls else "stop"
            return ChatTurn(message=item, finish_reason=finish)
        return item
