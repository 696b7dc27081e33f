"""Shared fixtures for env and sandbox tests: sandboxes of each available backend, closed after
the test whatever happens."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable

import pytest

from rl360.envs.sandbox import Sandbox, SandboxLimits, build_sandbox, unavailable_reason

LOCAL_BACKENDS = ["bwrap", "process"]

SandboxMaker = Callable[..., Sandbox]


# CI sets RL360_REQUIRE_SANDBOX=1 (.ci/run): there, "bwrap unavailable" or a bwrap protection
# that does not hold is a failure, so the suite cannot go green by skipping its security tests.
REQUIRE_SANDBOX = os.environ.get("RL360_REQUIRE_SANDBOX") == "1"


def _unavailable(backend: str, why: str) -> None:
    msg = f"{backend} sandbox unavailable: {why}"
    if REQUIRE_SANDBOX and backend == "bwrap":
        pytest.fail(f"{msg} (RL360_REQUIRE_SANDBOX=1: bwrap is required here)")
    pytest.skip(msg)


@pytest.fixture(params=LOCAL_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    why = unavailable_reason(request.param)
    if why is not None:
        _unavailable(request.param, why)
    return request.param


@pytest.fixture
def bwrap_backend() -> str:
    why = unavailable_reason("bwrap")
    if why is not None:
        _unavailable("bwrap", why)
    return "bwrap"


@pytest.fixture
async def make_sandbox() -> AsyncIterator[SandboxMaker]:
    made: list[Sandbox] = []

    def make(backend: str, workdir: str | None = None, **limits: object) -> Sandbox:
        sb = build_sandbox(backend, SandboxLimits(**limits), workdir)  # type: ignore[arg-type]
        made.append(sb)
        return sb

    yield make
    for sb in made:
        await sb.close()


def _require(sb: Sandbox, protection: str) -> None:
    """Skip (an expected gap, not a pass) when `sb` lacks `protection`."""
    if not getattr(sb.protections, protection):
        msg = f"{sb.backend} sandbox has no {protection} protection"
        if REQUIRE_SANDBOX and sb.backend == "bwrap":
            pytest.fail(f"{msg} (RL360_REQUIRE_SANDBOX=1: every bwrap protection must hold)")
        pytest.skip(f"{msg} (expected gap)")


@pytest.fixture
def require() -> Callable[[Sandbox, str], None]:
    return _require


@pytest.fixture
def fresh_ok(make_sandbox: SandboxMaker) -> Callable[[str], object]:
    """The host keeps going: a new sandbox runs a normal command."""

    async def check(backend: str) -> None:
        sb = make_sandbox(backend)
        res = await sb.exec(["python3", "-I", "-S", "-c", "print(6 * 7)"], timeout=10)
        assert res.ok, res
        assert res.stdout.strip() == "42"
        await sb.close()

    return check


async def _wait_until(predicate: Callable[[], object], within_s: float = 15.0) -> bool:
    """Poll `predicate` (sync or async) until it holds or `within_s` passes; its last value.
    Tests wait on the positive condition instead of sleeping a fixed time and then asserting."""
    import asyncio
    import inspect
    import time

    deadline = time.monotonic() + within_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value or time.monotonic() >= deadline:
            return bool(value)
        await asyncio.sleep(0.02)


@pytest.fixture
def wait_until() -> Callable[..., object]:
    return _wait_until
