"""Sandboxes: bwrap (default on Linux), process (fallback), docker (where an engine runs)."""

from rl360.envs.sandbox.base import (
    SANDBOXES,
    ExecResult,
    Protections,
    Sandbox,
    SandboxError,
    SandboxFileError,
    SandboxLimits,
    SandboxStartError,
    available_backends,
    build_sandbox,
    resolve_backend,
    unavailable_reason,
)

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
