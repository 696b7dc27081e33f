"""End to end: `rl360 index build` on the stdlib docs, the `search` Serve deployment, env actors
that hand envs the search service, and an example task (examples/search/tasks.jsonl) whose
scripted agent searches, reads the hit and answers: reward 1. The scripted engine answers only
when the tool response it reads holds the answer, so the reward depends on what search
returned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.serving import SERVE_PORT

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[3]

CALL = ('<tool_call>\n{"name": "search", "arguments": {"query": "%s", "k": 1}}\n</tool_call>')
RULES = [
    # the answer only when the search result in the tail holds it
    [r"builtins\.StopIteration: Signal the end[^<]*</tool_response>", "StopIteration"],
    [r"</tool_response>", "I could not find it."],
    [r"no further items", CALL % "iterator next signal no further items"],
    [r"null operation", CALL % "xyzzy plugh"],  # a query that finds nothing
]


def _tasks() -> dict[str, object]:
    from rl360.envs.tasks import iter_tasks

    return {t.id: t for t in iter_tasks(REPO / "examples/search/tasks.jsonl")}


def test_agent_searches_the_stdlib_docs_and_answers(ray_cluster, stdlib_index: Path) -> None:  # type: ignore[no-untyped-def]
    import msgspec
    import ray
    from transformers import AutoTokenizer

    from rl360.actors.env_pool import EnvPool
    from rl360.launch.search_app import start_search, stop_search
    from rl360.launch.serve_app import start_serving, stop_serving
    from rl360.launch.stack import service_specs
    from rl360.policies.loading import resolve_model_path
    from rl360.recipe import apply_overrides, decode_recipe

    data = apply_overrides({}, [
        "ray.namespace='rl360-tests'", "engine.backend='scripted'", "engine.num_cpus=0.25",
        f"serve.port={SERVE_PORT}", "env.num_cpus=0", "env.max_turns=3",
        f"search.index={json.dumps(str(stdlib_index))}", "search.num_cpus=0.25",
        "search.snippet_chars=200", "env.sandbox='process'", "serve.app_name='rl360-search-e2e'",
    ])
    data["engine"]["options"] = {"rules": RULES}
    recipe = decode_recipe(data)
    tasks = _tasks()
    serving = start_serving(recipe)
    search = None
    pool = None
    try:
        search = start_search(recipe)
        assert search is not None and search.url.endswith("/search")
        pool = EnvPool(recipe.env, msgspec.to_builtins(recipe.eval.sampling), serving.shard_names,
                       serving.namespace, serving.base_url, services=service_specs(recipe, search))
        good, blind = ray.get([pool.submit(tasks["stdlib-stopiteration"], "g1"),
                               pool.submit(tasks["stdlib-pass"], "g2")], timeout=300)
    finally:
        if pool is not None:
            pool.shutdown()
        stop_search(search)
        stop_serving(serving)
    assert good.status == "ok", good.error
    assert good.reward is not None and good.reward.value == 1.0
    tok = AutoTokenizer.from_pretrained(resolve_model_path("tiny"))
    text = tok.decode(good.tokens)
    # the tool response the agent read is the index's hit for its query
    assert "module:builtins#3" in text and "Signal the end from iterator.__next__()" in text
    assert good.counters.get("tool_calls") == 1
    # the same agent with a search that finds nothing gets no answer: reward 0
    assert blind.status == "ok", blind.error
    assert blind.reward is not None and blind.reward.value == 0.0
    assert "no results" in tok.decode(blind.tokens)
