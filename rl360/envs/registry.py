"""Env registry: built-in names and "package.module:Attr" strings, resolved where they run
(inside the env actor)."""

from __future__ import annotations

import importlib
from typing import Any

from rl360.envs.api import Env

BUILTIN_ENVS: dict[str, str] = {
    "code": "rl360.envs.code:CodeEnv",
    "harbor": "rl360.envs.harbor:HarborEnv",
    "tools": "rl360.envs.toolenv:ToolEnv",
    "synthetic": "rl360.envs.synthetic:SyntheticEnv",
}


def resolve(spec: str) -> Any:
    """Import "package.module:Attr" (Attr may be dotted) and return the attribute; errors name
    the string and what was missing."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"expected 'package.module:Attr', got {spec!r}")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected 'package.module:Attr', got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"cannot resolve {spec!r}: module {module_name!r} not importable ({e})"
        ) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(
                f"cannot resolve {spec!r}: {module_name!r} has no attribute {attr!r}"
            ) from None
    return obj


def env_class(name: str) -> type[Env]:
    """The Env class for a built-in name or a "package.module:Class" string."""
    spec = BUILTIN_ENVS.get(name, name)
    if ":" not in spec:
        raise ValueError(
            f"unknown env {name!r}; built-in: {sorted(BUILTIN_ENVS)}, or 'package.module:Class'"
        )
    cls = resolve(spec)
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise ValueError(f"{spec!r} is not a subclass of rl360.envs.api.Env")
    return cls


def build_env(name: str, **params: Any) -> Env:
    """A fresh env instance (one per episode)."""
    cls = env_class(name)
    try:
        return cls(**params)
    except TypeError as e:
        raise ValueError(f"bad parameters for env {name!r} {params}: {e}") from None
