"""Shared fixtures for env and sandbox tests: sandboxes of each available backend, closed after
the test whatever happens."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from rl360.envs.sandbox import Sandbox, SandboxLimits, build_sandbox, unavailable_reason

LOCAL_BACKENDS = ["bwrap", "process"]

SandboxMaker = Callable[..., Sandbox]


@pytest.fixture(params=LOCAL_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    why = unavailable_reason(request.param)
    if why is not None:
        pytest.skip(f"{request.param} sandbox unavailable: {why}")
    return request.param


@pytest.fixture
def bwrap_backend() -> str:
    why = unavailable_reason("bwrap")
    if why is not None:
        pytest.skip(f"bwrap sandbox unavailable: {why}")
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
        pytest.skip(f"{sb.backend} sandbox has no {protection} protection (expected gap)")


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
