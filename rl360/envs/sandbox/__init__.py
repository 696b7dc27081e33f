"""Sandboxes: bwrap (default on Linux), process (fallback), docker (where an engine runs)."""

from rl360.envs.sandbox.base import (
    ExecResult,
    Protections,
    Sandbox,
    SandboxError,
    SandboxFileError,
    SandboxStartError,
)
from rl360.envs.sandbox.factory import (
    SANDBOXES,
    available_backends,
    build_sandbox,
    resolve_backend,
    unavailable_reason,
)
from rl360.recipe import SandboxLimits

__all__ = [
    "SANDBOXES",
    "ExecResult",
    "Protections",
    "Sandbox",
    "SandboxError",
    "SandboxFileError",
    "SandboxLimits",
    "SandboxStartError",
    "available_backends",
    "build_sandbox",
    "resolve_backend",
    "unavailable_reason",
]
