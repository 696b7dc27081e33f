"""The token ledger of one session (token-in, token-out): a forest of token nodes. See
docs/TITO.md, sections 1-3.

Each node is one generation: its own tokens are the template delta rendered for the request's
new messages (mask 0) followed by what the engine generated (mask 1, with logprob and policy
version). A node's full token sequence (its snapshot) is its parent's snapshot plus its own
tokens; a root's own tokens start with the whole rendered first prompt. Shared prefixes are
therefore stored once, and nodes are never changed or deleted (TITO invariant 12).

A request attaches at the deepest node whose whole message history is a strict prefix of the
request's messages (the matcher of TITO case 9 decides equality; the stored messages and
tokens stay authoritative; ties go to the latest node). Where it diverges from a stored path it
branches (counted `prefix_changed`, or `retry` when it resends a stored request); a request
matching no root, or with another tool list, opens a new root (`new_root`). `n > 1` choices
and concurrent requests become siblings under the node they saw when they arrived.

A turn goes in two steps so that a rejected or failed request changes nothing (invariant 8):
`prepare()` validates and computes the prompt ids without touching state; `commit()` adds
the node(s), re-checking the session's caps. What the model generated is never re-encoded:
later turns append the chat template's token delta, rendered in the real conversation's
context and sliced at token level behind a prefix guard (case 2); junction tokens the engine
never emits (3); an alternate EOS is kept and counted (5); a reply cut by `max_tokens` is
continued with a synthetic end-of-turn junction (`truncated="continue"`, counted
`synthetic_eos`) or refused with 409 (`"reject"`, and the cut node stays a leaf) (6);
stop strings and stop tokens get the same synthetic end-of-turn (7); tool groups render in
one delta (11); client-injected assistant messages are prompt (13); per-token versions (19).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rl360.policies.chat import ChatRenderer
from rl360.serve.sessions.ledger_view import LedgerView, Node, Segment
from rl360.serve.sessions.matching import (
    MATCHERS,
    GuardFailed,
    group_messages,
    guard,
    tools_key,
)
from rl360.types import Generation, Message, ToolSpec

TRUNCATED_MODES = ("continue", "reject")
DELTA_CONTEXTS = ("turn", "conversation")


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

    parent: int | None  # the node this request attaches under; None: a new root
    segments: list[Segment]
    prompt_ids: list[int]
    new_messages: list[Message]
    tools: list[ToolSpec] | None = None
    tools_key: str = "[]"
    kind: str = "chat"  # "chat" | "completion"
    counters: Counter[str] = field(default_factory=Counter)
    branch: dict[str, Any] | None = None  # where and why it left a stored path


class SessionLedger(LedgerView):
    def __init__(
        self,
        session_id: str,
        renderer: ChatRenderer,
        matcher: str = "loose_tool_call",
        truncated: str = "continue",
        max_nodes: int = 1024,
        max_tokens: int = 1 << 20,
        delta_context: str = "turn",
    ) -> None:
        if matcher not in MATCHERS:
            raise ValueError(f"unknown message matcher {matcher!r}; known: {sorted(MATCHERS)}")
        if truncated not in TRUNCATED_MODES:
            raise ValueError(f"serve.truncated must be one of {TRUNCATED_MODES}, not {truncated!r}")
        if delta_context not in DELTA_CONTEXTS:
            raise ValueError(f"serve.delta_context must be one of {DELTA_CONTEXTS}, not "
                             f"{delta_context!r}")
        self.delta_context = delta_context
        self.session_id = session_id
        self.renderer = renderer
        self._same = MATCHERS[matcher]
        self.truncated_mode = truncated
        self.max_nodes = max_nodes
        self.max_tokens = max_tokens
        self.nodes: list[Node] = []
        self.roots: list[int] = []
        self.stored_tokens = 0
        self.branches: list[dict[str, Any]] = []
        self.counters: Counter[str] = Counter()

    def prepare(self, messages: list[Message], tools: list[ToolSpec] | None) -> PreparedTurn:
        if not messages:
            raise LedgerError(400, "empty_messages", "messages must not be empty")
        tools = tools or None
        self._check_node_cap(1)
        tkey = tools_key(tools)
        parent, _reach, diverged = self._attach(messages, tkey)
        if parent is None:
            prep = self._prepare_root(messages, tools, tkey)
            if self.roots:
                prep.counters["new_root"] += 1
                if all(self.nodes[r].tools_key != tkey for r in self.roots):
                    prep.counters["render_config_changed"] += 1
        else:
            node = self.nodes[parent]
            if node.kind != "chat":
                raise LedgerError(409, "mixed_apis", "this session's history holds a "
                                  "/v1/completions turn; use /v1/completions or a new session")
            if node.finish_reason == "length" and self.truncated_mode == "reject":
                self.counters["extend_truncated_rejected"] += 1
                raise LedgerError(
                    409,
                    "truncated",
                    "the previous generation was cut by max_tokens (finish_reason=length) and "
                    "this server has serve.truncated='reject'; resend the history before it to "
                    "branch from there",
                )
            prep = self._prepare_append(node, messages[node.history_len :])
        if diverged is not None:
            if diverged >= len(messages):  # the request resends a stored request: a retry
                prep.counters["retry"] += 1
            else:
                prep.counters["prefix_changed"] += 1
            prep.branch = {"first_divergent_index": diverged, "attached_at": parent}
        self._check_token_cap(prep)
        return prep

    def _attach(self, messages: list[Message], tkey: str) -> tuple[int | None, int, int | None]:
        """(deepest node whose history is a strict prefix of `messages`, its history length,
        and, when the request leaves a stored path (a sibling or another root it does not
        extend), the index of the first message where it differs from the closest one)."""
        best: int | None = None
        best_reach = 0
        further = -1  # how far the request matched a stored node it does not extend
        stack = [r for r in self.roots if self.nodes[r].tools_key == tkey and self.nodes[r].kind == "chat"]
        while stack:
            n = self.nodes[stack.pop()]
            k = 0
            rest = messages[n.n_history :]
            for a, b in zip(n.messages, rest, strict=False):
                if not self._same(b, a):
                    break
                k += 1
            reach = n.n_history + k
            if k == len(n.messages) and reach < len(messages):
                if reach > best_reach or (reach == best_reach and best is not None and n.id > best):
                    best, best_reach = n.id, reach
                stack.extend(n.children)
            else:
                further = max(further, reach)
        return best, best_reach, (further if further >= 0 else None)

    def _prepare_root(self, messages: list[Message], tools: list[ToolSpec] | None,
                      tkey: str) -> PreparedTurn:
        ids = self._render(messages, tools, add_generation_prompt=True)
        return PreparedTurn(parent=None, segments=[(ids, "prompt")], prompt_ids=list(ids),
                            new_messages=list(messages), tools=tools, tools_key=tkey)

    def _context(self, node: Node) -> list[Message]:
        """The synthetic context a delta is rendered in (TITO case 2): the conversation's
        leading system message, then `node`'s own messages (the request's new messages and its
        reply). Its size does not grow with the episode, so an append costs the new turn only."""
        if node.parent is None:
            return list(node.messages)
        root = node
        while root.parent is not None:
            root = self.nodes[root.parent]
        first = root.messages[0] if root.messages else None
        head = [first] if first is not None and first.role == "system" else []
        return [*head, *node.messages]

    def _prepare_append(self, node: Node, new: list[Message]) -> PreparedTurn:
        counters: Counter[str] = Counter()
        segments: list[Segment] | None = None
        if self.delta_context == "turn":
            try:
                segments = self._delta(self._context(node), node, new, counters)
            except (GuardFailed, LedgerError):
                # the template refuses the short context or renders it differently: render
                # in the whole conversation's context (O(conversation); counted)
                counters = Counter({"delta_full_context": 1})
        if segments is None:
            segments = self._delta(self.path_messages(node.id), node, new, counters, full=True)
        prompt = self.path_tokens(node.id)
        for ids, _ in segments:
            prompt += ids
        return PreparedTurn(parent=node.id, segments=segments, prompt_ids=prompt,
                            new_messages=list(new), tools=node.tools, tools_key=node.tools_key,
                            counters=counters)

    def _delta(self, context: list[Message], node: Node, new: list[Message],
               counters: Counter[str], full: bool = False) -> list[Segment]:
        """The junction and template delta that follow `node` for the `new` messages, rendered
        after `context` (whose render ends the way the stored path ends) and sliced at token
        level behind the prefix guard. Raises GuardFailed (or LedgerError for a template that
        rejects the context) when not `full` so the caller can retry in the full context."""
        r = self.renderer
        prefix = self._render(context, node.tools, add_generation_prompt=False)
        segments: list[Segment] = []
        # junction: what the template renders after the last end-of-turn, which the engine
        # never emits (e.g. the "\n" after <|im_end|>); TITO case 3
        try:
            k = len(prefix) - 1 - prefix[::-1].index(r.end_of_turn_id)
        except ValueError:
            k = len(prefix) - 1
        junction = prefix[k + 1 :]
        if node.stop_kind in ("stop_string", "stop_token") or node.finish_reason == "length":
            junction = [r.end_of_turn_id, *junction]  # the turn never ended: synthetic EOS
            counters["synthetic_eos"] += 1
            if node.finish_reason == "length":
                counters["continued_truncated"] += 1
        if junction:
            segments.append((junction, "junction"))
        # the new messages, one group at a time (consecutive tool results form one group)
        done = prefix
        sofar = list(context)
        try:
            for g in group_messages(new):
                sofar += g
                rendered = self._render(sofar, node.tools, add_generation_prompt=False)
                guard(done, rendered)
                prov = "client_assistant" if g[0].role == "assistant" else "delta"
                segments.append((rendered[len(done) :], prov))
                done = rendered
            rendered = self._render(sofar, node.tools, add_generation_prompt=True)
            guard(done, rendered)
            segments.append((rendered[len(done) :], "delta"))
        except GuardFailed:
            # a template whose per-group renders are not prefixes of each other: render the
            # whole suffix in one call (still guarded against the context's prefix)
            counters["delta_regrouped"] += 1
            rendered = self._render(context + new, node.tools, add_generation_prompt=True)
            try:
                guard(prefix, rendered)
            except GuardFailed as exc:
                if not full:
                    raise
                self.counters["delta_guard_failed"] += 1
                raise LedgerError(
                    422,
                    "delta_guard",
                    "the chat template does not render this conversation append-only "
                    f"({exc}); this model's template cannot be used for multi-turn sessions",
                ) from None
            segments = [s for s in segments if s[1] == "junction"]
            segments.append((rendered[len(prefix) :], "delta"))
        return [s for s in segments if s[0]]

    def _render(
        self, messages: list[Message], tools: list[ToolSpec] | None, add_generation_prompt: bool
    ) -> list[int]:
        try:
            return self.renderer.render(messages, tools, add_generation_prompt)
        except Exception as exc:  # jinja errors: the template rejects this conversation
            raise LedgerError(
                400, "template_error", f"the chat template cannot render these messages: {exc}"
            ) from None

    # ------------------------------------------------------------------ prepare (completions)

    def prepare_completion(self, ids: list[int]) -> PreparedTurn:
        """A /v1/completions turn attaches at the deepest completion node whose snapshot is a
        prefix of `ids` (the prompt must extend it at token level), else opens a new root."""
        if not ids:
            raise LedgerError(400, "empty_prompt", "prompt must not be empty")
        self._check_node_cap(1)
        if any(n.kind == "chat" for n in self.nodes):
            raise LedgerError(409, "mixed_apis", "this session already holds a chat; "
                              "use /v1/chat/completions or a new session")
        best: int | None = None
        best_len = 0
        stack = list(self.roots)
        while stack:
            n = self.nodes[stack.pop()]
            snap = self.path_tokens(n.id)
            if len(snap) <= len(ids) and ids[: len(snap)] == snap:
                if len(snap) > best_len or (len(snap) == best_len and best is not None and n.id > best):
                    best, best_len = n.id, len(snap)
                stack.extend(n.children)
        prep = PreparedTurn(parent=best, segments=[(list(ids[best_len:]),
                            "prompt" if best is None else "delta")], prompt_ids=list(ids),
                            new_messages=[], kind="completion")
        prep.segments = [s for s in prep.segments if s[0]]
        if best is None and self.roots:
            prep.counters["new_root"] += 1
        self._check_token_cap(prep)
        return prep

    # ------------------------------------------------------------------ caps

    def _check_node_cap(self, n: int) -> None:
        if len(self.nodes) + n > self.max_nodes:
            self.counters["node_cap_rejected"] += 1
            raise LedgerError(
                409, "session_node_cap",
                f"this session holds {len(self.nodes)} nodes and the request adds {n}; the cap "
                f"is serve.max_session_nodes={self.max_nodes}; open a new session")

    def _check_token_cap(self, prep: PreparedTurn, generated: int = 0) -> None:
        new = sum(len(ids) for ids, _ in prep.segments) + generated
        if self.stored_tokens + new > self.max_tokens:
            self.counters["token_cap_rejected"] += 1
            raise LedgerError(
                409, "session_token_cap",
                f"this session stores {self.stored_tokens} tokens and the request adds {new}; "
                f"the cap is serve.max_session_tokens={self.max_tokens}; open a new session")

    # ------------------------------------------------------------------ commit

    def commit(
        self, prep: PreparedTurn, choices: list[tuple[Generation, Message | None]],
        response_id: str,
    ) -> list[int]:
        """Add one node per choice (siblings under `prep.parent`, or roots). All or nothing:
        caps are re-checked here (concurrent requests may have grown the session)."""
        for gen, _ in choices:
            if len(gen.logprobs) != len(gen.token_ids):
                raise LedgerError(502, "engine_contract", "engine returned mismatched logprobs")
        self._check_node_cap(len(choices))
        self._check_token_cap(prep, sum(len(g.token_ids) for g, _ in choices))
        if prep.parent is not None and not 0 <= prep.parent < len(self.nodes):
            raise LedgerError(409, "unknown_parent", "the node this request attached to is gone")
        parent = self.nodes[prep.parent] if prep.parent is not None else None
        n_history = parent.history_len if parent is not None else 0
        prompt_len = len(prep.prompt_ids)
        ids: list[int] = []
        for i, (gen, reply) in enumerate(choices):
            versions = list(gen.token_versions or [gen.policy_version] * len(gen.token_ids))
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
            node = Node(
                id=len(self.nodes), parent=prep.parent, segments=prep.segments,
                gen_ids=list(gen.token_ids), gen_logprobs=list(gen.logprobs),
                gen_versions=versions,
                messages=[*prep.new_messages, *([reply] if reply is not None else [])],
                n_history=n_history, tools=prep.tools, tools_key=prep.tools_key, kind=prep.kind,
                response_id=response_id, choice=i, finish_reason=gen.finish_reason,
                stop_kind=stop_kind, prompt_len=prompt_len,
            )
            self.nodes.append(node)
            if parent is None:
                self.roots.append(node.id)
            else:
                parent.children.append(node.id)
            ids.append(node.id)
            self.stored_tokens += len(gen.token_ids)
        self.stored_tokens += sum(len(s) for s, _ in prep.segments)  # shared by the siblings
        self.counters.update(prep.counters)
        if len(choices) > 1:
            self.counters["n_siblings"] += len(choices)
        if prep.branch is not None:
            self.branches.append({**prep.branch, "nodes": ids})
        return ids
