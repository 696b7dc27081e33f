"""What `rl360 serve` and `rl360 eval` do, kept out of cli.py so --help stays import-free."""

from __future__ import annotations

import argparse
import time

from rl360.launch.recipe import Recipe, load_recipe


def _banner(recipe: Recipe, base_url: str, dashboard: str) -> str:
    lines = [
        f"rl360: serving {recipe.model.path!r} with {recipe.engine.replicas} "
        f"{recipe.engine.backend} engine replica(s)",
        f"  OpenAI API       {base_url}/v1   (sessionless, nothing recorded)",
        f"  open a session   curl -X POST {base_url}/sessions   -> id, token",
        f"  session API      {base_url}/sessions/<id>/v1   (api_key=<token>)",
        f"  trajectory       GET {base_url}/sessions/<id>/trajectory",
    ]
    if dashboard:
        lines.append(f"  Ray dashboard    {dashboard}")
    return "\n".join(lines)


def serve_main(args: argparse.Namespace) -> int:
    from rl360.launch.cluster import STOP, ray_session
    from rl360.serve.app import start_serving, stop_serving

    recipe = load_recipe(args.recipe, args.overrides)
    r = recipe.ray
    with ray_session(r.address, r.num_cpus, r.dashboard, r.namespace) as info:
        handles = start_serving(recipe)
        print(_banner(recipe, handles.base_url, info["dashboard_url"]), flush=True)
        try:
            deadline = time.monotonic() + args.duration if args.duration > 0 else None
            while not STOP.requested and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.5)
        finally:
            stop_serving(handles)
    return 0


def eval_main(args: argparse.Namespace) -> int:
    from rl360.launch.eval_run import run_eval

    recipe = load_recipe(args.recipe, args.overrides)
    if args.model:
        recipe.model.path = args.model
    return run_eval(recipe, calibrate=args.calibrate)
