"""The shard's client of the engine deployment: which Serve handle it calls through."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rl360.serve.engines import replica
from rl360.types import SamplingParams


class _Handle:
    """A stand-in DeploymentHandle that records its options and answers every call."""

    def __init__(self, log: list[dict[str, Any]], options: dict[str, Any] | None = None) -> None:
        self.log, self.opts = log, options or {}

    def options(self, **kw: Any) -> _Handle:
        self.log.append(kw)
        return _Handle(self.log, {**self.opts, **kw})

    def __getattr__(self, method: str) -> Any:
        handle = self

        class _Method:
            def remote(self, *args: Any) -> Any:
                async def answer() -> Any:
                    return {"method": method, "options": handle.opts}
                return asyncio.ensure_future(answer())

        return _Method()


def test_engine_calls_go_by_value_with_the_session_route(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[dict[str, Any]] = []
    monkeypatch.setattr(replica.serve, "get_deployment_handle",
                        lambda deployment, app_name: _Handle(log))
    client = replica.ServeEngineClient("rl360")
    got = asyncio.run(client.generate([1, 2], SamplingParams(max_tokens=1), "session-7"))
    assert got["method"] == "generate"
    # by value (Serve's direct gRPC channel), and routed by the session
    assert got["options"] == {"_by_reference": False, "session_id": "session-7"}
    got = asyncio.run(client.generate_many([], None))
    assert got["options"] == {"_by_reference": False}
    assert log.count({"_by_reference": False}) == 1  # the handle is made once and kept
