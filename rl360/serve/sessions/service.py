"""Agent sessions: the OpenAI chat/completions logic over a token ledger per session.

`SessionService` is plain Python (tested without Ray). In the running system each of K
`SessionShard` Ray actors hosts one; a session lives on the shard its id hashes to, so every
SessionServer replica (the HTTP ingress) reaches the same ledger, and RL360's own agent loop
can call the shard directly and write the same ledger.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from rl360.policies.chat import ChatRenderer
from rl360.recipe import ServeSection
from rl360.serve.sessions.auth import same_secret
from rl360.serve.sessions.bounds import (
    RequestBounds,
    refuse_control_fields,
    seeded,
    strip_stop_token,
)
from rl360.serve.sessions.ledger import LedgerError, PreparedTurn, SessionLedger
from rl360.serve.sessions.openai_types import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_completion_body,
    new_id,
)
from rl360.serve.sessions.picker import pick
from rl360.types import Generation, Message, SamplingParams

log = logging.getLogger("rl360.sessions")


class EngineClient(Protocol):
    """How a session reaches an engine. `route_key` keeps a session on one replica."""

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, route_key: str | None
    ) -> Generation: ...

    async def generate_many(
        self, items: list[tuple[list[int], SamplingParams]], route_key: str | None
    ) -> list[Generation | BaseException]:
        """Several generations in one request to one replica; a failed one is its exception."""
        ...


class LocalEngineClient:
    """An in-process backend as an EngineClient (tests, benchmarks, single-process use)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, route_key: str | None
    ) -> Generation:
        return await self.backend.generate(prompt_ids, sampling)

    async def generate_many(
        self, items: list[tuple[list[int], SamplingParams]], route_key: str | None
    ) -> list[Generation | BaseException]:
        return list(await asyncio.gather(*(self.generate(ids, sp, route_key)
                                           for ids, sp in items), return_exceptions=True))


@dataclass
class _Session:
    token: str
    ledger: SessionLedger
    metadata: dict[str, Any]
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    malformed_tool_calls: int = 0
    completions: int = 0


@dataclass
class _ChatCall:
    """A chat turn prepared for its generation (SessionService._chat_prepare)."""

    req: ChatCompletionRequest
    session: _Session | None
    ledger: SessionLedger
    prep: PreparedTurn
    sampling: SamplingParams
    route_key: str | None
    t0: float
    t_rendered: float


class SessionService:
    def __init__(self, renderer: ChatRenderer, engine: EngineClient, config: ServeSection, *,
                 max_model_len: int, model_name: str, vocab_size: int = 0) -> None:
        """`config`: the recipe's [serve] section; `max_model_len`: the model's context
        (model.max_model_len); `model_name`: what responses name as their model (run.name);
        `vocab_size`: the model's vocabulary (its embedding rows, which may exceed the
        tokenizer's; token ids outside it are refused), default the tokenizer's size."""
        self.renderer = renderer
        self.engine = engine
        self.config = config
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.sessions: dict[str, _Session] = {}
        self.events: Counter[str] = Counter()
        self.vocab_size = max(vocab_size, len(renderer.tokenizer))
        self.bounds = RequestBounds(
            max_model_len, self.vocab_size, config.default_max_tokens, renderer.eos_ids,
            # the longest text one token can stand for: a prompt with more characters than
            # max_model_len * this cannot fit and is refused before it is rendered
            max((len(t) for t in renderer.tokenizer.get_vocab()), default=1))
        # chat templates run here, off the event loop (one at a time: tokenizers are not
        # safe to share across threads)
        self._render_pool = ThreadPoolExecutor(1, thread_name_prefix="rl360-render")

    # ------------------------------------------------------------------ lifecycle

    def open(self, metadata: dict[str, Any] | None = None, matcher: str | None = None,
             session_id: str | None = None, token: str | None = None) -> dict[str, str]:
        """A new session: its id and bearer token. `token`: one the (in-cluster) caller chose,
        so it can close the session even when this answer never reaches it."""
        if token is not None and (not isinstance(token, str) or len(token) < 16):
            raise LedgerError(422, "bad_token", "a chosen session token must be a string of "
                              "at least 16 characters")
        sid = session_id or uuid.uuid4().hex
        if len(self.sessions) >= self.config.max_sessions_per_shard and not self.reap_idle():
            self.events["rejected_too_many_sessions"] += 1
            raise LedgerError(429, "too_many_sessions", f"this shard holds "
                              f"{len(self.sessions)} open sessions (serve.max_sessions_per_shard);"
                              " close finished sessions or retry later")
        if sid in self.sessions:
            raise LedgerError(409, "session_exists", "a session with this id is open")
        try:
            ledger = self._ledger(sid, matcher)
        except ValueError as exc:
            raise LedgerError(422, "bad_matcher", str(exc)) from None
        token = token or secrets.token_urlsafe(24)
        self.sessions[sid] = _Session(token=token, ledger=ledger, metadata=dict(metadata or {}))
        self.events["sessions_opened"] += 1
        return {"id": sid, "token": token}

    def _ledger(self, sid: str, matcher: str | None = None) -> SessionLedger:
        c = self.config
        return SessionLedger(sid, self.renderer, matcher or c.matcher, c.truncated,
                             c.max_session_nodes, c.max_session_tokens, c.delta_context)

    def _get(self, sid: str, token: str | None) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            raise LedgerError(404, "unknown_session", f"no open session {sid!r}")
        if not same_secret(token, s.token):
            raise LedgerError(401, "unauthorized", "missing or wrong bearer token for this session")
        s.last_used = time.monotonic()
        return s

    def trajectory(self, sid: str, token: str | None, forest: bool = True) -> dict[str, Any]:
        """The picked samples (top level: the latest picked leaf; `branches`: the others),
        plus the whole `forest`, the ids of the `picked` leaves and the `branch_points`."""
        s = self._get(sid, token)
        try:
            traj = s.ledger.trajectory(self.config.picker)
        except ValueError as exc:
            raise LedgerError(500, "bad_picker", str(exc)) from None
        traj.counters["malformed_tool_calls"] = s.malformed_tool_calls
        traj.task_id = s.metadata.get("task_id")
        traj.group_id = s.metadata.get("group_id")
        out = msgspec.to_builtins(traj)
        out.setdefault("branches", [])
        out["picked"] = pick(s.ledger, self.config.picker)
        if forest:  # the env actor needs only the samples
            out["forest"] = s.ledger.forest()
            out["branch_points"] = list(s.ledger.branches)
        return out

    def close(self, sid: str, token: str | None, forest: bool = True) -> dict[str, Any]:
        traj = self.trajectory(sid, token, forest)
        del self.sessions[sid]
        self.events["sessions_closed"] += 1
        return traj

    def reap_idle(self) -> int:
        cutoff = time.monotonic() - self.config.session_ttl_s
        stale = [sid for sid, s in self.sessions.items() if s.last_used < cutoff]
        for sid in stale:
            del self.sessions[sid]
        self.events["sessions_reaped"] += len(stale)
        return len(stale)

    def stats(self) -> dict[str, Any]:
        ledger_events: Counter[str] = Counter()
        for s in self.sessions.values():
            ledger_events.update(s.ledger.counters)
        return {"open_sessions": len(self.sessions), **self.events, "ledger": dict(ledger_events)}

    # ------------------------------------------------------------------ chat

    async def chat(
        self, sid: str | None, token: str | None, req: ChatCompletionRequest
    ) -> dict[str, Any] | ApiError:
        return await self._answer(self._chat(sid, token, req))

    async def _answer(self, call: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any] | ApiError:
        """The call's response, or the refusal it raised as an ApiError (counted)."""
        try:
            return await call
        except LedgerError as exc:
            return self._refused(exc)

    async def _chat(
        self, sid: str | None, token: str | None, req: ChatCompletionRequest
    ) -> dict[str, Any]:
        call = await self._chat_prepare(sid, token, req)
        gens = await self._generate_n(call.prep.prompt_ids, call.sampling, call.route_key, req.n)
        return self._chat_finish(call, gens)

    async def chat_many(
        self, calls: list[tuple[str, str | None, ChatCompletionRequest]]
    ) -> list[dict[str, Any] | ApiError]:
        """Several sessions' chat turns with one engine call (`EngineClient.generate_many`):
        each (session id, token, request) is refused, prepared and committed on its own, as
        `chat` would; their generations travel to the engine together (routed by the first
        call's key). The built-in agent loop sends a group's first turns this way: one engine
        request instead of group_size. Answers in the order of `calls`."""
        out: list[dict[str, Any] | ApiError | None] = [None] * len(calls)
        ready: list[tuple[int, _ChatCall]] = []
        for i, (sid, token, req) in enumerate(calls):
            try:
                ready.append((i, await self._chat_prepare(sid, token, req)))
            except LedgerError as exc:
                out[i] = self._refused(exc)
        items = [(c.prep.prompt_ids, sp) for _, c in ready
                 for sp in seeded(c.sampling, c.req.n)]
        gens: list[Generation | BaseException] = []
        try:
            if len(ready) == 1:  # one session's turn: the engine's plain generate
                c = ready[0][1]
                gens = list(await self._generate_n(c.prep.prompt_ids, c.sampling, c.route_key,
                                                   c.req.n))
            elif items:
                gens = await self._generate_many(items, ready[0][1].route_key)
        except LedgerError as exc:
            gens = [exc] * len(items)
        k = 0
        for i, c in ready:
            mine, k = gens[k:k + c.req.n], k + c.req.n
            bad = next((g for g in mine if isinstance(g, BaseException)), None)
            if bad is None:
                out[i] = self._chat_finish(c, mine)  # type: ignore[arg-type]
            else:
                out[i] = self._refused(bad if isinstance(bad, LedgerError) else LedgerError(
                    503, "engine_unavailable", f"engine call failed: {bad!r}"))
        return [o for o in out if o is not None]

    def _refused(self, exc: LedgerError) -> ApiError:
        self.events[f"rejected_{exc.code}"] += 1
        return ApiError(exc.status, exc.code, exc.message)

    async def _chat_prepare(
        self, sid: str | None, token: str | None, req: ChatCompletionRequest
    ) -> _ChatCall:
        """Refuse what cannot run, capture the parent and render the prompt (TITO 17): all
        of a chat turn before its generation."""
        refuse_control_fields(req.input_ids, req.prompt_token_ids, req.n, self.config.max_n)
        if isinstance(req.tool_choice, dict) or req.tool_choice not in (None, "auto", "none"):
            raise LedgerError(400, "unsupported", "tool_choice must be 'auto' or 'none' here")
        messages = [m.to_message() for m in req.messages]
        self.bounds.check_size(messages, req.tools)
        if sid is None:  # sessionless call: an ephemeral ledger, nothing is kept
            session = None
            ledger = self._ledger("ephemeral")
        else:
            session = self._get(sid, token)
            ledger = session.ledger
        # the parent is captured here (TITO 17); rendering runs off the event loop
        t0 = time.monotonic()
        prep = await self._off_loop(ledger.prepare, messages, req.tools)
        sampling = self.bounds.sampling(
            len(prep.prompt_ids), req.temperature, req.top_p, req.top_k,
            req.max_completion_tokens or req.max_tokens, req.stop, req.stop_token_ids, req.seed,
            priority=req.priority,
        )
        # a group's sessions go to one engine replica (their prompts share a prefix); the
        # metadata of an HTTP session is the client's: only a non-empty string routes
        gid = session.metadata.get("group_id") if session is not None else None
        route = gid if isinstance(gid, str) and gid else sid
        return _ChatCall(req, session, ledger, prep, sampling, route, t0, time.monotonic())

    def _chat_finish(self, call: _ChatCall, gens: list[Generation]) -> dict[str, Any]:
        """Parse the generations, commit them under the captured parent, answer."""
        req, ledger, session, prep = call.req, call.ledger, call.session, call.prep
        t2 = time.monotonic()
        replies: list[tuple[Generation, Message]] = []
        malformed = 0
        for gen in gens:
            text = self.renderer.decode(strip_stop_token(gen))
            if gen.stop_string and gen.stop_string in text:
                text = text[: text.index(gen.stop_string)]
            if req.tool_choice == "none":
                reply = Message(role="assistant", content=text)
            else:
                parsed = self.renderer.parse_assistant(text)
                reply = Message(role="assistant", content=parsed.content,
                                tool_calls=parsed.tool_calls or None)
                malformed += parsed.malformed_tool_calls
            replies.append((gen, reply))
        response_id = new_id("chatcmpl")
        ledger.commit(prep, replies, response_id)  # n siblings under the captured parent
        if session is not None:
            session.malformed_tool_calls += malformed
            session.completions += 1
        self.events["chat_completions"] += 1
        self.events["malformed_tool_calls"] += malformed
        choices = []
        for gen, reply in replies:
            finish = "tool_calls" if reply.tool_calls else gen.finish_reason
            lps = None
            if req.logprobs:
                lps = [
                    {"token": self.renderer.decode([t]), "logprob": lp, "token_id": t}
                    for t, lp in zip(gen.token_ids, gen.logprobs, strict=True)
                ]
            choices.append((reply, finish, lps))
        first = gens[0]
        extra = {
            "policy_version": first.policy_version,
            "malformed_tool_calls": malformed,
            "stop_kind": first.stop_kind,
            "engine_replica": first.engine_replica,
            # where this call's time went on the server (the step breakdown sums them)
            "timings": {"render_s": call.t_rendered - call.t0, "engine_s": t2 - call.t_rendered,
                        "commit_s": time.monotonic() - t2},
        }
        return chat_completion_body(
            response_id, req.model or self.model_name, choices,
            len(prep.prompt_ids), sum(len(g.token_ids) for g in gens), extra,
        )

    # ------------------------------------------------------------------ completions

    async def complete(
        self, sid: str | None, token: str | None, req: CompletionRequest
    ) -> dict[str, Any] | ApiError:
        return await self._answer(self._complete(sid, token, req))

    async def _complete(
        self, sid: str | None, token: str | None, req: CompletionRequest
    ) -> dict[str, Any]:
        refuse_control_fields(None, None, req.n, 1)
        if isinstance(req.prompt, list):
            ids = list(req.prompt)
            self.bounds.check_ids(ids, "prompt")
        else:
            self.bounds.check_text(req.prompt)
            ids = await self._off_loop(self.renderer.encode, req.prompt)
        if not ids:
            raise LedgerError(400, "empty_prompt", "prompt must not be empty")
        session = self._get(sid, token) if sid is not None else None
        ledger = session.ledger if session is not None else self._ledger("ephemeral")
        prep = ledger.prepare_completion(ids)
        sampling = self.bounds.sampling(len(prep.prompt_ids), req.temperature, req.top_p,
                                        req.top_k, req.max_tokens or 16, req.stop,
                                        req.stop_token_ids, req.seed, eos=False,
                                        priority=req.priority)
        gen = await self._generate(ids, sampling, sid)
        text = self.renderer.decode(gen.token_ids)
        if gen.stop_string and gen.stop_string in text:
            text = text[: text.index(gen.stop_string)]
        response_id = new_id("cmpl")
        ledger.commit(prep, [(gen, None)], response_id)
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": gen.finish_reason,
                                  "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = {
                "tokens": [self.renderer.decode([t]) for t in gen.token_ids],
                "token_logprobs": list(gen.logprobs),
            }
        return {
            "id": response_id, "object": "text_completion", "created": int(time.time()),
            "model": req.model or self.model_name, "choices": [choice],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(gen.token_ids),
                      "total_tokens": len(ids) + len(gen.token_ids)},
            "rl360": {"policy_version": gen.policy_version},
        }

    # ------------------------------------------------------------------ shared

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._render_pool, fn, *args)

    async def _generate_n(self, ids: list[int], sampling: SamplingParams, sid: str | None,
                          n: int) -> list[Generation]:
        if n == 1:
            return [await self._generate(ids, sampling, sid)]
        return list(await asyncio.gather(*(
            self._generate(ids, sp, sid) for sp in seeded(sampling, n))))

    async def _generate_many(self, items: list[tuple[list[int], SamplingParams]],
                             route_key: str | None) -> list[Generation | BaseException]:
        """The generations of `items` in one engine request; a failed one is its exception."""
        try:
            return list(await self.engine.generate_many(items, route_key))
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:
            log.exception("engine call failed")
            raise LedgerError(503, "engine_unavailable", f"engine call failed: {exc!r}") from None

    async def _generate(self, ids: list[int], sampling: SamplingParams, sid: str | None) -> Generation:
        try:
            return await self.engine.generate(ids, sampling, sid)
        except LedgerError:
            raise
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:
            log.exception("engine call failed")
            raise LedgerError(503, "engine_unavailable", f"engine call failed: {exc!r}") from None
