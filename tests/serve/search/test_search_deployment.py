"""The `search` deployment over real HTTP (POST /search): one query, a list of queries, the
same hits as the index in process, concurrent requests answered in shared batches, and bad
requests answered 400 with a one-line reason."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.serving import SERVE_PORT

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def search_app(ray_cluster, stdlib_index: Path):  # type: ignore[no-untyped-def]
    from ray import serve

    from rl360.launch.search_app import start_search, stop_search
    from rl360.recipe import apply_overrides, decode_recipe

    recipe = decode_recipe(apply_overrides({}, [
        f"serve.port={SERVE_PORT}", f"search.index={json.dumps(str(stdlib_index))}",
        "search.num_cpus=0", "search.max_k=8", "search.batch_wait_ms=50",
        "serve.app_name='rl360-search-http'"]))
    serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
    handles = start_search(recipe)
    assert handles is not None
    try:
        yield handles
    finally:
        stop_search(handles)


def test_one_query_and_many_match_the_index_in_process(search_app, stdlib_index: Path) -> None:  # type: ignore[no-untyped-def]
    import httpx

    from rl360.serve.search.index import SearchIndex

    idx = SearchIndex.load(stdlib_index)
    r = httpx.post(search_app.url, json={"query": "json decode error", "k": 3}, timeout=60)
    assert r.status_code == 200, r.text
    hits = r.json()["hits"]
    assert [h["id"] for h in hits] == [h.id for h in idx.search(["json decode error"], 3)[0]]
    assert set(hits[0]) == {"id", "doc_id", "title", "snippet", "score"}
    qs = ["return a list of strings", "yield expression generator", "zzzz"]
    r = httpx.post(search_app.url, json={"queries": qs, "k": 50}, timeout=60)
    results = r.json()["results"]
    assert [[h["id"] for h in row] for row in results] == [
        [h.id for h in row] for row in idx.search(qs, 8)]  # k capped at search.max_k = 8
    assert len(results[0]) == 8 and results[2] == []


def test_snippets_false_answers_the_same_hits_without_text(search_app, stdlib_index: Path) -> None:  # type: ignore[no-untyped-def]
    import httpx

    qs = ["sort a list in place", "context manager protocol"]
    full = httpx.post(search_app.url, json={"queries": qs, "k": 5}, timeout=60).json()["results"]
    r = httpx.post(search_app.url, json={"queries": qs, "k": 5, "snippets": False}, timeout=60)
    assert r.status_code == 200, r.text
    bare = r.json()["results"]
    assert all(set(h) == {"id", "doc_id", "title", "score"} for row in bare for h in row)
    assert [[{k: v for k, v in h.items() if k != "snippet"} for h in row] for row in full] == bare
    assert bare[0] and full[0][0]["snippet"]


def test_concurrent_requests_share_batches(search_app) -> None:  # type: ignore[no-untyped-def]
    import httpx
    from ray import serve

    async def fire() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(*(c.post(search_app.url, json={"query": f"list sort {i}"})
                                        for i in range(24)))
        return [r.status_code for r in rs]

    handle = serve.get_deployment_handle("search", app_name=search_app.app_name)
    before = handle.stats.remote().result()
    assert asyncio.run(fire()) == [200] * 24
    after = handle.stats.remote().result()
    served, batches = after["served"] - before["served"], after["batches"] - before["batches"]
    assert served == 24 and batches < served  # several requests per retrieval call


@pytest.mark.parametrize("body, why", [
    ({"k": 3}, "exactly one of `query`"),
    ({"query": "a", "queries": ["b"]}, "exactly one of `query`"),
    ({"query": "a", "k": 0}, "`k` must be >= 1"),
    ({"query": "a", "mode": "dense"}, "needs a dense index"),
    ({"query": "a", "typo": 1}, "unknown field `typo`"),
])
def test_bad_requests_get_400_with_the_reason(search_app, body, why) -> None:  # type: ignore[no-untyped-def]
    import httpx

    r = httpx.post(search_app.url, json=body, timeout=60)
    assert r.status_code == 400 and why in r.json()["error"]
    assert httpx.get(search_app.url, timeout=60).status_code == 405
