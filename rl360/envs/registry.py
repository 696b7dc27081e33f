"""Env registry: built-in names and "package.module:Attr" strings, resolved where they run
(inside the env actor)."""

from __future__ import annotations

import importlib
import inspect
import typing
from typing import Any

import msgspec

from rl360.envs.api import Env

BUILTIN_ENVS: dict[str, str] = {
    "code": "rl360.envs.code:CodeEnv",
    "harbor": "rl360.envs.harbor:HarborEnv",
    "tools": "rl360.envs.toolenv:ToolEnv",
    "synthetic": "rl360.envs.synthetic:SyntheticEnv",
    "agent": "rl360.envs.agent_worker:AgentWorkerEnv",  # an agent program on Harbor tasks
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


def params_for(env: str, params: dict[str, Any], kind: str) -> dict[str, Any]:
    """The constructor parameters of the env that runs a task of `kind`: `env.params` itself
    when env.env names the env, else its sub-table for that kind (`[env.params.code]`)."""
    if env:
        return dict(params)
    sub = params.get(kind, {})
    return dict(sub) if isinstance(sub, dict) else {}


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls.__init__)
    except Exception:  # unresolvable annotations: the constructor call still checks
        return {}


def _check_one(name: str, params: dict[str, Any], where: str) -> None:
    cls = env_class(name)
    sig = inspect.signature(cls.__init__)
    named = [p for p in list(sig.parameters.values())[1:]
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    open_ended = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    takes = ", ".join(p.name for p in named) or "no parameters"
    for key in params:
        if key not in {p.name for p in named} and not open_ended:
            raise ValueError(f"{where}.{key}: env {name!r} ({cls.__module__}:{cls.__qualname__}) "
                             f"has no parameter {key!r}; it takes: {takes}")
    hints = _hints(cls)
    for key, value in params.items():
        if key in hints:
            try:
                msgspec.convert(value, hints[key], strict=False)
            except (msgspec.ValidationError, TypeError) as e:
                raise ValueError(f"{where}.{key}: {e} (env {name!r})") from None
    try:
        cls(**_typed(params, hints))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: env {name!r} rejects its parameters: {e}") from None


def _typed(params: dict[str, Any], hints: dict[str, Any]) -> dict[str, Any]:
    """TOML values converted to the constructor's annotated types (a TOML array for a tuple
    parameter becomes a tuple)."""
    out = {}
    for k, v in params.items():
        try:
            out[k] = msgspec.convert(v, hints[k], strict=False) if k in hints else v
        except (msgspec.ValidationError, TypeError):
            out[k] = v
    return out


def check_env_params(env: str, params: dict[str, Any]) -> None:
    """Check `env.params` against the env's constructor (names, annotated types, and one
    construction); raise ValueError naming the bad key. With env.env = "" every sub-table is
    checked against the env of its kind."""
    if env:
        _check_one(env, params, "env.params")
        return
    for kind, sub in params.items():
        if not isinstance(sub, dict):
            raise ValueError(f"env.params.{kind}: with env.env = \"\" (env chosen by task kind) "
                             "env.params holds one table per kind, e.g. [env.params.code]")
        if kind not in BUILTIN_ENVS:
            raise ValueError(f"env.params.{kind}: no built-in env {kind!r}; "
                             f"known: {sorted(BUILTIN_ENVS)}")
        _check_one(kind, sub, f"env.params.{kind}")


def build_env_for(env: str, params: dict[str, Any], kind: str) -> Env:
    """The env for a task of `kind` under the recipe's env.env / env.params."""
    name = env or kind
    p = params_for(env, params, kind)
    if not p:
        return build_env(name)
    return build_env(name, **_typed(p, _hints(env_class(name))))
