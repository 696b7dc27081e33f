"""A checker for the TITO invariants (docs/TITO.md section 2) over a session's trajectory
as GET /sessions/{id}/trajectory returns it: the forest, the picked samples, the responses."""

from __future__ import annotations

import math
from typing import Any

# tool specs the session tests offer (two lists, so a conversation can switch between them)
BASH = [{"type": "function", "function": {"name": "bash", "description": "run a command",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
SEARCH = [{"type": "function", "function": {"name": "search", "description": "web search",
           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]

SAMPLE_KEYS = ("tokens", "mask", "logprobs", "versions", "provenance")


def snapshots(forest: list[dict[str, Any]]) -> dict[int, list[int]]:
    snap: dict[int, list[int]] = {}
    for n in forest:  # parents come first: ids are the commit order
        base = [] if n["parent"] is None else snap[n["parent"]]
        snap[n["id"]] = base + n["tokens"]
    return snap


def check_sample(s: dict[str, Any]) -> None:
    n = len(s["tokens"])
    assert all(len(s[k]) == n for k in SAMPLE_KEYS), "equal lengths (5)"
    for m, lp, v, p in zip(s["mask"], s["logprobs"], s["versions"], s["provenance"], strict=True):
        assert (m == 1) == (p == "generated"), "mask <=> provenance (4)"
        if m:
            assert lp is not None and math.isfinite(lp) and lp <= 0 and v is not None
        else:
            assert lp is None and v is None
            assert p in ("prompt", "delta", "junction", "client_assistant")


def check_trajectory(traj: dict[str, Any], responses: list[dict[str, Any]] = (),  # type: ignore[assignment]
                     truncated_closed: bool = False) -> dict[int, list[int]]:
    """Assert every invariant that the HTTP view allows; returns the node snapshots."""
    forest = traj["forest"]
    ids = [n["id"] for n in forest]
    assert ids == list(range(len(forest))), "seq strictly increases, nothing deleted (12)"
    by_id = {n["id"]: n for n in forest}
    snap = snapshots(forest)
    for n in forest:
        if n["parent"] is not None:
            assert n["parent"] < n["id"] and n["id"] in by_id[n["parent"]]["children"]
        prov = n["provenance"]
        k = prov.count("generated")
        assert prov[len(prov) - k :] == ["generated"] * k, "the completion ends the node"
        assert n["completion_tokens"] == k
        parent_len = 0 if n["parent"] is None else len(snap[n["parent"]])
        # prefix growth (2) and coverage (3): the prompt the engine got is the parent's
        # snapshot plus this node's junction and delta, and nothing else
        assert n["prompt_tokens"] == parent_len + len(prov) - k
        if truncated_closed and n["finish_reason"] == "length":
            assert not n["children"], "truncated nodes stay closed (11)"
    leaves = {n["id"] for n in forest if not n["children"]}
    picked = traj["picked"]
    assert len(set(picked)) == len(picked) and set(picked) <= leaves, "picker: leaves, no dups"
    samples = [*traj["branches"], {**traj, "node": picked[-1]}] if picked else []
    assert [s["node"] for s in samples] == picked
    for s in samples:
        check_sample(s)
        assert s["tokens"] == snap[s["node"]], "a sample is its leaf's snapshot (12)"
    # every response id maps to exactly one node per choice (10), with the engine's counts (5)
    for r in responses:
        nodes = [n for n in forest if n["response_id"] == r["id"]]
        assert sorted(n["choice"] for n in nodes) == list(range(len(r["choices"])))
        assert all(n["prompt_tokens"] == r["usage"]["prompt_tokens"] for n in nodes)
        assert sum(n["completion_tokens"] for n in nodes) == r["usage"]["completion_tokens"]
    return snap


def check_engine_fidelity(snap: dict[int, list[int]], forest: list[dict[str, Any]],
                          calls: list[list[int]]) -> None:
    """Invariant 1: every prompt the engine got is a node's snapshot up to its generation."""
    prompts = [snap[n["id"]][: n["prompt_tokens"]] for n in forest]
    for c in calls:
        assert c in prompts
