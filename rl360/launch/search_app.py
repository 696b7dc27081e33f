"""Starts the `search` Serve deployment as its own Serve app (route `search.route`, default
/search, next to the rl360 app on the same HTTP proxies) when the recipe's [search] section
names an index.

    handles = start_search(recipe, placement)    # None when search.index is ""
    handles.url                                  # http://127.0.0.1:8000/search
    stop_search(handles)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rl360.recipe import Recipe, RecipeError

if TYPE_CHECKING:
    from rl360.launch.roles import Placement


@dataclass
class SearchHandles:
    app_name: str
    url: str


def search_app_name(recipe: Recipe) -> str:
    return f"{recipe.serve.app_name}-search"


def search_url(recipe: Recipe) -> str:
    from rl360.launch.serve_app import base_url

    return base_url(recipe) + recipe.search.route


def check_search(recipe: Recipe) -> None:
    """Fail before anything starts: a missing index directory names the key."""
    s = recipe.search
    if s.index and not (Path(s.index) / "meta.json").is_file():
        raise RecipeError(f"search.index: {s.index!r} is not a search index (build one with "
                          "`rl360 index build CORPUS --out DIR`)")
    if not s.route.startswith("/") or s.route == "/":
        raise RecipeError(f"search.route: {s.route!r} must be a path like '/search'")


def start_search(recipe: Recipe, placement: Placement | None = None,
                 timeout_s: float = 300.0) -> SearchHandles | None:
    """Deploy the search app (Serve must already be started); None when search is off."""
    s = recipe.search
    if not s.index:
        return None
    check_search(recipe)
    from ray import serve

    from rl360.launch.roles import LocalPlacement
    from rl360.launch.serve_app import DRAIN_POLL_S, SAME_LOOP_ENV, _wait_running, with_env
    from rl360.serve.search.deployment import SearchDeployment

    placement = placement or LocalPlacement(recipe)
    name = search_app_name(recipe)
    app = serve.deployment(
        SearchDeployment,
        name="search",
        num_replicas=s.replicas,
        max_ongoing_requests=s.max_ongoing_requests,
        ray_actor_options=with_env(placement.service_options(s.num_cpus), SAME_LOOP_ENV),
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
        logging_config={"enable_access_log": False},
    ).bind(str(Path(s.index).resolve()), max_batch_size=s.max_batch_size,
           batch_wait_ms=s.batch_wait_ms, default_k=s.default_k, max_k=s.max_k,
           snippet_chars=s.snippet_chars, mode=s.mode)
    t0 = time.monotonic()
    serve.run(app, name=name, route_prefix=s.route, blocking=False)
    _wait_running(name, timeout_s - (time.monotonic() - t0))
    return SearchHandles(app_name=name, url=search_url(recipe))


def stop_search(handles: SearchHandles | None) -> None:
    if handles is None:
        return
    from ray import serve

    serve.delete(handles.app_name)
