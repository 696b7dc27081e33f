"""Helpers for tests that run the real Serve app on the local Ray cluster."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rl360.ray_session import free_port
from rl360.recipe import apply_overrides, decode_recipe

# one Serve HTTP port for the whole test session (Serve keeps the first proxy's port), free
# at start-up so a developer's running `rl360 serve` on 8000 does not collide with the tests
SERVE_PORT = free_port()


@contextmanager
def serving(overrides: list[str], options: dict[str, Any] | None = None) -> Iterator[Any]:
    from rl360.launch.serve_app import start_serving, stop_serving

    data = apply_overrides({}, ["ray.namespace='rl360-tests'", "engine.num_cpus=0.5",
                                f"serve.port={SERVE_PORT}", *overrides])
    if options:
        data.setdefault("engine", {})["options"] = options
    handles = start_serving(decode_recipe(data))
    try:
        yield handles
    finally:
        stop_serving(handles)


def open_session(base_url: str) -> tuple[str, str]:
    import httpx

    r = httpx.post(f"{base_url}/sessions", json={"metadata": {"task_id": "t1"}}, timeout=30)
    assert r.status_code == 201, r.text
    body = r.json()
    return body["id"], body["token"]
