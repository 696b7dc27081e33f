"""Helpers for tests that run the real Serve app on the local Ray cluster."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rl360.launch.recipe import apply_overrides, decode_recipe


@contextmanager
def serving(overrides: list[str], options: dict[str, Any] | None = None) -> Iterator[Any]:
    from rl360.serve.app import start_serving, stop_serving

    data = apply_overrides({}, ["ray.namespace='rl360-tests'", "engine.num_cpus=0.5", *overrides])
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
