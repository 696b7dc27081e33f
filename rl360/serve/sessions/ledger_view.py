"""The token ledger's nodes and how it is read (rl360.serve.sessions.ledger.SessionLedger):
a node's path (its snapshot: every token from its root, with mask, logprob, version and
provenance), the picked leaves as a trajectory, the forest, and the re-render check of a path
against the chat template (docs/TITO.md, invariant 7)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rl360.policies.chat import ChatRenderer
from rl360.serve.sessions.matching import compare_segments
from rl360.serve.sessions.picker import pick
from rl360.types import Message, Sample, ToolSpec, Trajectory

Segment = tuple[list[int], str]  # (ids, provenance), appended before generation


@dataclass
class Node:
    id: int  # == seq: strictly increasing, never reused
    parent: int | None
    segments: list[Segment]  # shared (not copied) by the n choices of one request
    gen_ids: list[int]
    gen_logprobs: list[float]
    gen_versions: list[int]
    messages: list[Message]  # the request's new messages, then the reply (chat nodes)
    n_history: int  # messages on the path before this node's own
    tools: list[ToolSpec] | None
    tools_key: str
    kind: str
    response_id: str
    choice: int
    finish_reason: str
    stop_kind: str
    prompt_len: int  # snapshot length when generation started (the engine's input_ids)
    children: list[int] = field(default_factory=list)

    @property
    def own_len(self) -> int:
        return sum(len(ids) for ids, _ in self.segments) + len(self.gen_ids)

    @property
    def history_len(self) -> int:
        return self.n_history + len(self.messages)


@dataclass
class Path:
    """A node's snapshot: every token from its root to it, with the per-token fields."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    provenance: list[str] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)


class LedgerView:
    """The reading half of a SessionLedger, over its nodes."""

    session_id: str
    renderer: ChatRenderer
    nodes: list[Node]
    counters: Counter[str]

    def path(self, nid: int) -> Path:
        chain: list[Node] = []
        cur: int | None = nid
        while cur is not None:
            chain.append(self.nodes[cur])
            cur = self.nodes[cur].parent
        p = Path(nodes=chain[::-1])
        for n in p.nodes:
            for ids, prov in n.segments:
                k = len(ids)
                p.tokens += ids
                p.mask += [0] * k
                p.logprobs += [None] * k
                p.versions += [None] * k
                p.provenance += [prov] * k
            k = len(n.gen_ids)
            p.tokens += n.gen_ids
            p.mask += [1] * k
            p.logprobs += n.gen_logprobs
            p.versions += n.gen_versions
            p.provenance += ["generated"] * k
            p.messages += n.messages
        return p

    def _chain(self, nid: int) -> list[Node]:
        chain: list[Node] = []
        cur: int | None = nid
        while cur is not None:
            chain.append(self.nodes[cur])
            cur = self.nodes[cur].parent
        return chain[::-1]

    def path_tokens(self, nid: int) -> list[int]:
        """A node's snapshot tokens alone (what the engine is sent)."""
        out: list[int] = []
        for n in self._chain(nid):
            for ids, _ in n.segments:
                out += ids
            out += n.gen_ids
        return out

    def path_messages(self, nid: int) -> list[Message]:
        return [m for n in self._chain(nid) for m in n.messages]

    def leaves(self) -> list[int]:
        return [n.id for n in self.nodes if not n.children]

    # ------------------------------------------------------------------ prepare (chat)

    def sample(self, nid: int) -> Sample:
        p = self.path(nid)
        leaf = self.nodes[nid]
        return Sample(
            node=nid, tokens=p.tokens, mask=p.mask, logprobs=p.logprobs, versions=p.versions,
            provenance=p.provenance, messages=p.messages, turns=len(p.nodes),
            truncated=leaf.finish_reason == "length", rerender=self.rerender_check(p, leaf),
        )

    def trajectory(self, picker: str = "all") -> Trajectory:
        """The picked leaves as samples: the latest is the top-level sample, the others are
        `branches`. An empty ledger gives an empty trajectory."""
        picked = [self.sample(n) for n in pick(self, picker)]
        counters = dict(self.counters)
        if not picked:
            return Trajectory(session_id=self.session_id, tokens=[], mask=[], logprobs=[],
                              versions=[], provenance=[], counters=counters,
                              rerender={"match": True})
        top = picked[-1]
        return Trajectory(
            session_id=self.session_id, tokens=top.tokens, mask=top.mask, logprobs=top.logprobs,
            versions=top.versions, provenance=top.provenance, messages=top.messages,
            turns=top.turns, truncated=top.truncated, counters=counters, rerender=top.rerender,
            branches=picked[:-1],
        )

    def forest(self) -> list[dict[str, Any]]:
        """Every node, with its own tokens (its snapshot is its parent's plus these)."""
        out = []
        for n in self.nodes:
            own = [t for ids, _ in n.segments for t in ids] + n.gen_ids
            prov = [p for ids, p in n.segments for _ in ids] + ["generated"] * len(n.gen_ids)
            out.append({
                "id": n.id, "parent": n.parent, "children": list(n.children), "kind": n.kind,
                "response_id": n.response_id, "choice": n.choice,
                "finish_reason": n.finish_reason, "stop_kind": n.stop_kind,
                "prompt_tokens": n.prompt_len, "completion_tokens": len(n.gen_ids),
                "tokens": own, "provenance": prov, "messages": n.history_len,
            })
        return out

    def rerender_check(self, p: Path | None = None, leaf: Node | None = None) -> dict[str, Any]:
        """Re-render a path's conversation and compare with the ledger (TITO invariant 7)."""
        if p is None or leaf is None or not p.messages or leaf.kind != "chat":
            return {"match": True}
        try:
            ids = self.renderer.render(p.messages, leaf.tools, add_generation_prompt=False)
        except Exception as exc:
            return {"match": False, "error": f"template cannot re-render: {exc}"}
        eot = self.renderer.end_of_turn_id
        if eot in ids:
            if p.tokens and p.tokens[-1] in self.renderer.eos_ids:
                # the trailing junction after the final end-of-turn is not in the ledger yet
                ids = ids[: len(ids) - ids[::-1].index(eot)]
            elif leaf.finish_reason == "length" or leaf.stop_kind in ("stop_string", "stop_token"):
                # the final turn never ended: its end-of-turn is not in the ledger either
                ids = ids[: len(ids) - ids[::-1].index(eot) - 1]
        if ids == p.tokens:
            return {"match": True}
        return {"match": False, **compare_segments(p.tokens, ids, self.renderer, p.mask)}
