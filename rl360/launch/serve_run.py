"""`rl360 serve`: the engines and the session server of a recipe, until Ctrl-C (or
`--duration`), with the endpoints printed for any OpenAI-compatible agent."""

from __future__ import annotations

import argparse
import time

from rl360.launch.stack import running_stack
from rl360.ray_session import STOP
from rl360.recipe import Recipe


def _banner(recipe: Recipe, base_url: str, dashboard: str, search_url: str = "") -> str:
    lines = [
        f"rl360: serving {recipe.model.path!r} with {recipe.engine.replicas} "
        f"{recipe.engine.backend} engine replica(s)",
        f"  OpenAI API       {base_url}/v1   (sessionless, nothing recorded)",
        f"  open a session   curl -X POST {base_url}/sessions   -> id, token",
        f"  session API      {base_url}/sessions/<id>/v1   (api_key=<token>)",
        f"  trajectory       GET {base_url}/sessions/<id>/trajectory",
    ]
    if search_url:
        lines.append(f"  search           curl {search_url} -d '{{\"query\": \"...\", \"k\": 5}}'")
    if dashboard:
        lines.append(f"  Ray dashboard    {dashboard}")
    return "\n".join(lines)


def serve_command(recipe: Recipe, args: argparse.Namespace) -> int:
    """`rl360 serve recipe.toml [--duration S]`: engines + session server until Ctrl-C."""

    with running_stack(recipe, env_actors=False) as stack:
        print(_banner(recipe, stack.serving.base_url, stack.info["dashboard_url"],
                      stack.search.url if stack.search is not None else ""), flush=True)
        deadline = time.monotonic() + args.duration if args.duration > 0 else None
        while not STOP.requested and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.5)
    return 0
