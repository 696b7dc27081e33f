"""The token ledger of one session (token-in, token-out). See docs/TITO.md.

A linear ledger: one chain of tokens per session. Each token carries its id, a loss mask
(1 only on tokens the engine generated in this session), the sampling logprob and policy
version (None on tokens the engine did not generate) and a provenance tag.

A turn goes in two steps so that a rejected or failed request changes nothing (invariant 8):
`prepare()` validates the request against the stored conversation and computes the prompt ids
without touching state; `commit()` appends the template delta and the generation atomically,
and refuses if another request committed in between (concurrent requests in one session).

What the model generated is never re-encoded. Later turns are appended as the chat template's
token delta, rendered in the real conversation's context and sliced at token level behind a
prefix guard (TITO case 2). Handled cases: junction tokens the engine never emits (3), an
alternate EOS (5), `max_tokens` truncation closes the chain (6), stop strings and stop tokens
get a synthetic end-of-turn junction (7), tool groups rendered in one delta (11), empty
content with tool calls (12), client-injected assistant messages as prompt (13), a retry of
the latest turn replaces it and keeps the abandoned attempt (14), tools changed mid-session
rejected (21), per-token versions (19). A deep rewrite of history (15), n>1 (16) and
concurrent siblings (17) need a tree ledger; here they are rejected with 409/400 and counted.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rl360.policies.chat import ChatRenderer
from rl360.types import Generation, Message, ToolSpec, Trajectory


class LedgerError(Exception):
    """A request the ledger refuses; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass
class PreparedTurn:
    """Everything a commit needs, computed without touching the ledger."""

    seq: int  # ledger seq at prepare time; commit refuses if it moved
    base_len: int  # keep tokens[:base_len] (shorter than the ledger only on a retry)
    base_messages: int  # keep messages[:base_messages]
    segments: list[tuple[list[int], str]]  # (ids, provenance) appended before generation
    prompt_ids: list[int]
    new_messages: list[Message]
    tools: list[ToolSpec] | None = None
    retry: bool = False
    counters: Counter[str] = field(default_factory=Counter)


@dataclass
class _Turn:
    prompt_len: int  # tokens in the ledger when generation started
    base_len: int  # tokens before this turn's delta
    base_messages: int
    request_messages: list[Message]
    response_id: str
    finish_reason: str
    stop_kind: str
    n_generated: int


class SessionLedger:
    def __init__(self, session_id: str, renderer: ChatRenderer, matcher: str = "loose_tool_call"):
        if matcher not in MATCHERS:
            raise ValueError(f"unknown message matcher {matcher!r}; known: {sorted(MATCHERS)}")
        self.session_id = session_id
        self.renderer = renderer
        self._same = MATCHERS[matcher]
        self.tokens: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float | None] = []
        self.versions: list[int | None] = []
        self.provenance: list[str] = []
        self.messages: list[Message] = []
        self.tools: list[ToolSpec] | None = None
        self.turns: list[_Turn] = []
        self.abandoned: list[dict[str, Any]] = []
        self.counters: Counter[str] = Counter()
        self.seq = 0

    # ------------------------------------------------------------------ prepare

    def prepare(self, messages: list[Message], tools: list[ToolSpec] | None) -> PreparedTurn:
        if not messages:
            raise LedgerError(400, "empty_messages", "messages must not be empty")
        tools = tools or None
        if not self.turns:
            return self._prepare_first(messages, tools)
        if _tools_key(tools) != _tools_key(self.tools):
            self.counters["render_config_changed"] += 1
            raise LedgerError(
                409,
                "tools_changed",
                "the tool list cannot change within a session (it is rendered into the first "
                "system block); open a new session",
            )
        stored = self.messages
        if len(messages) > len(stored) and all(
            self._same(a, b) for a, b in zip(messages, stored, strict=False)
        ):
            last = self.turns[-1]
            if last.finish_reason == "length":
                self.counters["extend_truncated_rejected"] += 1
                raise LedgerError(
                    409,
                    "truncated",
                    "the previous generation was cut by max_tokens (finish_reason=length) and "
                    "cannot be extended; resend the history before it to branch from there",
                )
            return self._prepare_append(messages[len(stored) :], len(self.tokens), len(stored))
        last = self.turns[-1]
        if len(messages) == len(last.request_messages) and all(
            self._same(a, b) for a, b in zip(messages, last.request_messages, strict=True)
        ):
            # the same request again: a retry of the latest turn (TITO case 14)
            prep = self._replay(last)
            prep.retry = True
            return prep
        idx = _first_divergence(messages, stored, self._same)
        self.counters["prefix_changed"] += 1
        raise LedgerError(
            409,
            "history_diverged",
            f"messages[{idx}] differs from what this session recorded (or the request drops "
            "the latest reply); a linear ledger only appends. Send the recorded history "
            "(the replies this server returned) or open a new session",
        )

    def _prepare_first(self, messages: list[Message], tools: list[ToolSpec] | None) -> PreparedTurn:
        ids = self._render(messages, tools, add_generation_prompt=True)
        return PreparedTurn(
            seq=self.seq,
            base_len=0,
            base_messages=0,
            segments=[(ids, "prompt")],
            prompt_ids=list(ids),
            new_messages=list(messages),
            tools=tools,
        )

    def _replay(self, turn: _Turn) -> PreparedTurn:
        segments: list[tuple[list[int], str]] = []
        i = turn.base_len
        while i < turn.prompt_len:  # the turn's own delta, in runs of one provenance
            j = i
            while j < turn.prompt_len and self.provenance[j] == self.provenance[i]:
                j += 1
            segments.append((self.tokens[i:j], self.provenance[i]))
            i = j
        return PreparedTurn(
            seq=self.seq,
            base_len=turn.base_len,
            base_messages=turn.base_messages,
            segments=segments,
            prompt_ids=self.tokens[: turn.prompt_len],
            new_messages=turn.request_messages[turn.base_messages :],
            tools=self.tools,
        )

    def _prepare_append(self, new: list[Message], base_len: int, n_stored: int) -> PreparedTurn:
        r = self.renderer
        counters: Counter[str] = Counter()
        prefix = self._render(self.messages, self.tools, add_generation_prompt=False)
        segments: list[tuple[list[int], str]] = []
        # junction: what the template renders after the last end-of-turn, which the engine
        # never emits (e.g. the "\n" after <|im_end|>); TITO case 3
        try:
            k = len(prefix) - 1 - prefix[::-1].index(r.end_of_turn_id)
        except ValueError:
            k = len(prefix) - 1
        junction = prefix[k + 1 :]
        last_kind = self.turns[-1].stop_kind
        if last_kind in ("stop_string", "stop_token"):
            junction = [r.end_of_turn_id, *junction]  # the turn never ended: synthetic EOS
            counters["synthetic_eos"] += 1
        if junction:
            segments.append((junction, "junction"))
        # the new messages, one group at a time (consecutive tool results form one group)
        done = prefix
        groups = _group_messages(new)
        sofar = list(self.messages)
        try:
            for g in groups:
                sofar += g
                full = self._render(sofar, self.tools, add_generation_prompt=False)
                _guard(done, full)
                prov = "client_assistant" if g[0].role == "assistant" else "delta"
                segments.append((full[len(done) :], prov))
                done = full
            full = self._render(sofar, self.tools, add_generation_prompt=True)
            _guard(done, full)
            segments.append((full[len(done) :], "delta"))
        except _GuardFailed:
            # a template whose per-group renders are not prefixes of each other: render the
            # whole suffix in one call (still guarded against the stored prefix)
            counters["delta_regrouped"] += 1
            full = self._render(self.messages + new, self.tools, add_generation_prompt=True)
            try:
                _guard(prefix, full)
            except _GuardFailed as exc:
                self.counters["delta_guard_failed"] += 1
                raise LedgerError(
                    422,
                    "delta_guard",
                    "the chat template does not render this conversation append-only "
                    f"({exc}); this model's template cannot be used for multi-turn sessions",
                ) from None
            segments = [s for s in segments if s[1] == "junction"]
            segments.append((full[len(prefix) :], "delta"))
        segments = [s for s in segments if s[0]]
        prompt = list(self.tokens)
        for ids, _ in segments:
            prompt += ids
        return PreparedTurn(
            seq=self.seq,
            base_len=base_len,
            base_messages=n_stored,
            segments=segments,
            prompt_ids=prompt,
            new_messages=list(new),
            counters=counters,
        )

    def _render(
        self, messages: list[Message], tools: list[ToolSpec] | None, add_generation_prompt: bool
    ) -> list[int]:
        try:
            return self.renderer.render(messages, tools, add_generation_prompt)
        except Exception as exc:  # jinja errors: the template rejects this conversation
            raise LedgerError(
                400, "template_error", f"the chat template cannot render these messages: {exc}"
            ) from None

    # ------------------------------------------------------------------ commit

    def commit(
        self, prep: PreparedTurn, gen: Generation, reply: Message, response_id: str
    ) -> None:
        if prep.seq != self.seq:
            self.counters["concurrent_conflict"] += 1
            raise LedgerError(
                409,
                "concurrent_request",
                "another request of this session committed while this one was generating; "
                "a linear ledger takes one request at a time per session",
            )
        if len(gen.logprobs) != len(gen.token_ids):
            raise LedgerError(502, "engine_contract", "engine returned mismatched logprobs")
        if prep.retry:
            self.counters["retry"] += 1
            self.abandoned.append(
                {"tokens": self.tokens[prep.base_len :], "messages": len(self.messages)}
            )
        if prep.retry:  # the replaced turn (and nothing before it) leaves the chain
            self.turns = [t for t in self.turns if t.base_len < prep.base_len]
        del self.tokens[prep.base_len :]
        del self.mask[prep.base_len :]
        del self.logprobs[prep.base_len :]
        del self.versions[prep.base_len :]
        del self.provenance[prep.base_len :]
        del self.messages[prep.base_messages :]
        for ids, prov in prep.segments:
            self._extend(ids, 0, [None] * len(ids), [None] * len(ids), prov)
        prompt_len = len(self.tokens)
        versions = gen.token_versions or [gen.policy_version] * len(gen.token_ids)
        self._extend(gen.token_ids, 1, list(gen.logprobs), list(versions), "generated")
        self.messages += prep.new_messages
        self.messages.append(reply)
        if not self.turns and prep.base_len == 0:
            self.tools = prep.tools
        stop_kind = gen.stop_kind
        if stop_kind == "eos" and gen.token_ids and gen.token_ids[-1] != self.renderer.end_of_turn_id:
            stop_kind = "eos_alias"  # TITO case 5: keep the model's id, count it
            self.counters["eos_alias"] += 1
        if stop_kind == "stop_string":
            self.counters["stopped_on_string"] += 1
        if gen.finish_reason == "length":
            self.counters["truncated"] += 1
        if len(set(versions)) > 1:
            self.counters["mixed_version_turns"] += 1
        self.counters.update(prep.counters)
        self.turns.append(
            _Turn(
                prompt_len=prompt_len,
                base_len=prep.base_len,
                base_messages=prep.base_messages,
                request_messages=self.messages[: prep.base_messages] + prep.new_messages,
                response_id=response_id,
                finish_reason=gen.finish_reason,
                stop_kind=stop_kind,
                n_generated=len(gen.token_ids),
            )
        )
        self.seq += 1

    def commit_completion(self, prep: PreparedTurn, gen: Generation) -> None:
        """Append a /v1/completions turn: the prompt extension, then the generation."""
        if prep.seq != self.seq:
            self.counters["concurrent_conflict"] += 1
            raise LedgerError(409, "concurrent_request", "another request of this session "
                              "committed while this one was generating")
        for ids, prov in prep.segments:
            self._extend(ids, 0, [None] * len(ids), [None] * len(ids), prov)
        versions = gen.token_versions or [gen.policy_version] * len(gen.token_ids)
        self._extend(gen.token_ids, 1, list(gen.logprobs), list(versions), "generated")
        self.seq += 1

    def _extend(
        self, ids: list[int], m: int, lps: list[float | None], vs: list[int | None], prov: str
    ) -> None:
        self.tokens += ids
        self.mask += [m] * len(ids)
        self.logprobs += lps
        self.versions += vs
        self.provenance += [prov] * len(ids)

    # ------------------------------------------------------------------ export

    def trajectory(self) -> Trajectory:
        return Trajectory(
            session_id=self.session_id,
            tokens=list(self.tokens),
            mask=list(self.mask),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            provenance=list(self.provenance),
            messages=list(self.messages),
            turns=len(self.turns),
            truncated=bool(self.turns) and self.turns[-1].finish_reason == "length",
            counters=dict(self.counters),
            rerender=self.rerender_check(),
        )

    def rerender_check(self) -> dict[str, Any]:
        """Re-render the final conversation and compare with the ledger (TITO invariant 7)."""
        if not self.messages:
            return {"match": True}
        try:
            ids = self.renderer.render(self.messages, self.tools, add_generation_prompt=False)
        except Exception as exc:
            return {"match": False, "error": f"template cannot re-render: {exc}"}
        # the trailing junction after the final end-of-turn is not in the ledger yet
        eot = self.renderer.end_of_turn_id
        if self.tokens and self.tokens[-1] in self.renderer.eos_ids and eot in ids:
            ids = ids[: len(ids) - ids[::-1].index(eot)]
        if ids == self.tokens:
            return {"match": True}
        return {"match": False, **compare_segments(self.tokens, ids, self.renderer)}


# ---------------------------------------------------------------------- helpers


class _GuardFailed(Exception):
    pass


def _guard(prefix: list[int], full: list[int]) -> None:
    """TITO invariant 6: full[:len(prefix)] == prefix, at token level."""
    if full[: len(prefix)] != prefix:
        i = next((i for i, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b), len(full))
        raise _GuardFailed(f"render of the longer conversation differs at token {i}")


def _group_messages(msgs: list[Message]) -> list[list[Message]]:
    groups: list[list[Message]] = []
    for m in msgs:
        if groups and m.role == "tool" and groups[-1][-1].role == "tool":
            groups[-1].append(m)
        else:
            groups.append([m])
    return groups


def _tools_key(tools: list[ToolSpec] | None) -> str:
    return json.dumps(msgspec.to_builtins(tools or []), sort_keys=True)


def _content(m: Message) -> str:
    return m.content or ""


def _same_strict(a: Message, b: Message) -> bool:
    """Roles, content (None == ""), tool call names and argument text; ids/index ignored."""
    if a.role != b.role or _content(a) != _content(b) or a.tool_call_id != b.tool_call_id:
        return False
    ca, cb = a.tool_calls or [], b.tool_calls or []
    return len(ca) == len(cb) and all(
        x.function.name == y.function.name and x.function.arguments == y.function.arguments
        for x, y in zip(ca, cb, strict=True)
    )


def _json_or_text(s: str) -> Any:
    try:
        return json.loads(s)
    except (json.JSONDecodeError, ValueError):
        return s


def _same_loose_tool_call(a: Message, b: Message) -> bool:
    """As strict, but tool arguments compare as JSON objects and tool_call_id is ignored
    when one side lacks it."""
    if a.role != b.role or _content(a) != _content(b):
        return False
    if a.tool_call_id and b.tool_call_id and a.tool_call_id != b.tool_call_id:
        return False
    ca, cb = a.tool_calls or [], b.tool_calls or []
    return len(ca) == len(cb) and all(
        x.function.name == y.function.name
        and _json_or_text(x.function.arguments) == _json_or_text(y.function.arguments)
        for x, y in zip(ca, cb, strict=True)
    )


MATCHERS = {"strict": _same_strict, "loose_tool_call": _same_loose_tool_call}


def _first_divergence(a: list[Message], b: list[Message], same: Any) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if not same(x, y):
            return i
    return min(len(a), len(b))


def compare_segments(ledger: list[int], rendered: list[int], r: ChatRenderer) -> dict[str, Any]:
    """Split both sequences at special tokens and classify the differences (TITO inv. 7)."""

    def split(ids: list[int]) -> tuple[list[int], list[list[int]]]:
        specials: list[int] = []
        texts: list[list[int]] = [[]]
        for t in ids:
            if t in r.special_ids:
                specials.append(t)
                texts.append([])
            else:
                texts[-1].append(t)
        return specials, texts

    sa, ta = split(ledger)
    sb, tb = split(rendered)
    out: dict[str, Any] = {
        "special_token_count": abs(len(sa) - len(sb)),
        "special_token_type": 0,
        "eos_alias": 0,
        "assistant_text": 0,
        "non_assistant_text": 0,
    }
    for x, y in zip(sa, sb, strict=False):
        if x != y:
            if x in r.alt_eos_ids and y == r.end_of_turn_id:
                out["eos_alias"] += 1
            else:
                out["special_token_type"] += 1
    for x, y in zip(ta, tb, strict=False):
        if x != y:
            text = r.decode(y[:3]) if y else r.decode(x[:3])
            key = "assistant_text" if text.startswith("ass") else "non_assistant_text"
            out[key] += 1
    return out
