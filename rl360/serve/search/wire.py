"""POST /search bodies. A request holds one `query` (what an agent's tool call sends) or a list
of `queries` (a client that batches itself); the answer mirrors it: `hits` for one query,
`results` (one list of hits per query) for many."""

from __future__ import annotations

from typing import Literal

import msgspec

from rl360.serve.search.index import Hit


class SearchRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    query: str | None = None
    queries: list[str] | None = None
    k: int | None = None  # None: the deployment's default_k; capped at its max_k
    mode: Literal["bm25", "dense", "hybrid"] | None = None
    snippets: bool = True  # false: hits carry id, doc_id, title and score only


class SearchResponse(msgspec.Struct, omit_defaults=True):
    hits: list[Hit] | None = None
    results: list[list[Hit]] | None = None


class SearchError(ValueError):
    """A bad request; the message is what the caller sees (HTTP 400)."""


def check_request(req: SearchRequest, max_query_chars: int = 4000, max_queries: int = 1024) -> list[str]:
    """The request's queries, or SearchError naming what is wrong."""
    if (req.query is None) == (req.queries is None):
        raise SearchError("give exactly one of `query` (a string) or `queries` (a list of strings)")
    qs = [req.query] if req.query is not None else list(req.queries or [])
    if not qs or len(qs) > max_queries:
        raise SearchError(f"`queries` must hold 1..{max_queries} strings")
    if any(len(q) > max_query_chars for q in qs):
        raise SearchError(f"a query is longer than {max_query_chars} characters")
    if req.k is not None and req.k < 1:
        raise SearchError("`k` must be >= 1")
    return qs
