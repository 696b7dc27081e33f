"""The `search` Serve deployment: POST /search answered from a SearchIndex, with the queries of
concurrent requests gathered by `serve.batch` and answered in one retrieval call per batch
(off the event loop, so requests keep arriving while a batch is scored).

The class is plain; rl360.launch.search_app wraps it with `serve.deployment` (replicas and
resources from the recipe's [search] section)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import msgspec
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from rl360.serve.search.index import Hit, Searcher, SearchIndex
from rl360.serve.search.wire import SearchError, SearchRequest, SearchResponse, check_request

_Item = tuple[tuple[str, ...], int, str, bool]  # (queries, k, mode, snippets) of one request


class SearchDeployment:
    def __init__(self, index_dir: str, *, max_batch_size: int = 64, batch_wait_ms: float = 2.0,
                 default_k: int = 5, max_k: int = 50, snippet_chars: int = 300,
                 mode: str = "bm25", searcher: Searcher | None = None) -> None:
        self.index: Any = searcher or SearchIndex.load(index_dir, snippet_chars)
        self.default_k, self.max_k, self.mode = default_k, max_k, mode
        if mode != "bm25" and not getattr(self.index, "has_dense", False):
            raise ValueError(f"search.mode = {mode!r} needs a dense index; {index_dir} has none "
                             "(rebuild it with --embed-model)")
        self._batched.set_max_batch_size(max_batch_size)
        self._batched.set_batch_wait_timeout_s(batch_wait_ms / 1000.0)
        self._dec = msgspec.json.Decoder(SearchRequest)
        self.served = 0
        self.batches = 0

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.002)
    async def _batched(self, items: list[_Item]) -> list[list[list[Hit]]]:
        """One retrieval per (mode, snippets) over every query of the batch, at the batch's
        largest k; each request gets its own queries' hits cut to its own k."""
        by_kind: dict[tuple[str, bool], list[int]] = defaultdict(list)
        for i, (_, _, mode, snippets) in enumerate(items):
            by_kind[(mode, snippets)].append(i)
        out: list[list[list[Hit]]] = [[] for _ in items]
        for (mode, snippets), idx in by_kind.items():
            flat = [q for i in idx for q in items[i][0]]
            k = max(items[i][1] for i in idx)
            hits = await asyncio.to_thread(self.index.search, flat, k, mode, snippets)
            pos = 0
            for i in idx:
                n, ki = len(items[i][0]), items[i][1]
                out[i] = [h[:ki] for h in hits[pos : pos + n]]
                pos += n
        self.served += sum(len(it[0]) for it in items)
        self.batches += 1
        return out

    async def search(self, queries: list[str], k: int | None = None,
                     mode: str | None = None, snippets: bool = True) -> list[list[Hit]]:
        """For DeploymentHandle callers (same rules as the HTTP route)."""
        req = SearchRequest(queries=list(queries), k=k, mode=mode,  # type: ignore[arg-type]
                            snippets=snippets)
        qs = check_request(req)
        return await self._batched((tuple(qs), self._k(req.k), req.mode or self.mode, snippets))

    def _k(self, k: int | None) -> int:
        return min(self.max_k, k or self.default_k)

    async def __call__(self, request: Request) -> Response:
        if request.method != "POST":
            return _error(405, "POST a JSON body {query, k} to this route")
        try:
            req = self._dec.decode(await request.body())
            qs = check_request(req)
            mode = req.mode or self.mode
            if mode != "bm25" and not getattr(self.index, "has_dense", False):
                raise SearchError(f"mode {mode!r} needs a dense index; this one has none")
        except (msgspec.DecodeError, SearchError) as exc:
            return _error(400, str(exc))
        hits = await self._batched((tuple(qs), self._k(req.k), mode, req.snippets))
        body = SearchResponse(hits=hits[0]) if req.query is not None else SearchResponse(results=hits)
        return Response(msgspec.json.encode(body), media_type="application/json")

    def stats(self) -> dict[str, int]:
        return {"served": self.served, "batches": self.batches, "chunks": len(self.index.chunks)}


def _error(status: int, message: str) -> Response:
    return Response(msgspec.json.encode({"error": message}), status_code=status,
                    media_type="application/json")
