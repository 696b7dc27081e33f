"""The sandbox backends by name and `build_sandbox`: a plain table, no registration.

Each backend is a class taking `(limits=, workdir=, **options)` plus a probe that says why it
cannot run on this host (None when it can). To add a backend, write it beside the others and
list it in `SANDBOXES` and `AVAILABLE`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rl360.envs.sandbox.base import Sandbox, SandboxStartError
from rl360.envs.sandbox.bwrap import BwrapSandbox, bwrap_unavailable
from rl360.envs.sandbox.docker import DockerSandbox, docker_unavailable
from rl360.envs.sandbox.process import ProcessSandbox
from rl360.recipe import SandboxLimits

log = logging.getLogger(__name__)
SandboxFactory = Callable[..., Sandbox]
SANDBOXES: dict[str, SandboxFactory] = {
    "bwrap": BwrapSandbox,
    "process": ProcessSandbox,
    "docker": DockerSandbox,
}
# backend -> probe returning why it cannot run here, or None
AVAILABLE: dict[str, Callable[[], str | None]] = {
    "bwrap": bwrap_unavailable,
    "process": lambda: None,
    "docker": docker_unavailable,
}


def unavailable_reason(backend: str) -> str | None:
    """Why `backend` cannot run on this host, or None when it can."""
    if backend not in AVAILABLE:
        raise ValueError(f"unknown sandbox backend {backend!r}; known: {sorted(SANDBOXES)}")
    return AVAILABLE[backend]()


def available_backends() -> list[str]:
    return [name for name in SANDBOXES if AVAILABLE[name]() is None]


UNSANDBOXED_HINT = (
    "set env.allow_unsandboxed = true to run on the process backend (no isolation), "
    "or install bubblewrap"
)


def resolve_backend(backend: str, allow_unsandboxed: bool = False) -> str:
    """ "auto" -> bwrap when bubblewrap works here; else "process" only with
    allow_unsandboxed, otherwise SandboxStartError with the reason. Never a silent downgrade."""
    if backend != "auto":
        return backend
    why = unavailable_reason("bwrap")
    if why is None:
        return "bwrap"
    if not allow_unsandboxed:
        raise SandboxStartError(f"sandbox 'auto': bwrap is unavailable ({why}); {UNSANDBOXED_HINT}")
    log.warning("sandbox 'auto' runs UNSANDBOXED (process backend): bwrap unavailable: %s", why)
    return "process"


def build_sandbox(
    backend: str = "auto",
    limits: SandboxLimits | None = None,
    workdir: str | None = None,
    allow_unsandboxed: bool = False,
    **options: Any,
) -> Sandbox:
    """Build an (unstarted) sandbox. `workdir` is the writable directory where commands start:
    a path inside the sandbox for bwrap/docker (default /sandbox), a host directory for the
    process backend (default a fresh private temp dir). Backend options (e.g. scratch_dirs,
    image) pass through."""
    name = resolve_backend(backend, allow_unsandboxed)
    if name not in SANDBOXES:
        raise ValueError(f"unknown sandbox backend {backend!r}; known: auto, {sorted(SANDBOXES)}")
    why = AVAILABLE[name]()
    if why is not None:
        raise SandboxStartError(f"sandbox backend {name!r} is unavailable here: {why}")
    return SANDBOXES[name](limits=limits or SandboxLimits(), workdir=workdir, **options)
