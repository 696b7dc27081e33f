"""Reading a recipe: TOML, `--set` overrides, decoding with one-line errors that name the
key, and the keys that moved (refused with the key they moved to).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from msgspec import inspect as mi

from rl360.recipe.base import T
from rl360.recipe.envs import EnvSection
from rl360.recipe.schema import Recipe
from rl360.recipe.train import TrainSection
from rl360.recipe.trainer import TrainerSection


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the key and what is allowed."""


_TYPE_NAMES = {"float": "a float", "int": "an int", "str": "a string", "bool": "a boolean",
               "array": "a list", "object": "a table"}  # fmt: skip


def _describe(info: Any) -> str:
    """'a float in (0, 1]', 'an int >= 1', "one of 'a', 'b'" from msgspec type info."""
    if isinstance(info, mi.LiteralType):
        return "one of " + ", ".join(repr(v) for v in info.values)
    if isinstance(info, mi.ListType) and info.min_length:
        return f"a list of at least {info.min_length} item(s)"
    if isinstance(info, mi.StrType) and info.pattern:
        return f"a string matching {info.pattern}"
    kind = {mi.FloatType: "a float", mi.IntType: "an int"}.get(type(info))
    if kind is None:
        return "a valid value"
    lo = ("(", info.gt) if info.gt is not None else ("[", info.ge) if info.ge is not None else None
    hi = (")", info.lt) if info.lt is not None else ("]", info.le) if info.le is not None else None
    if lo and hi:
        return f"{kind} in {lo[0]}{lo[1]:g}, {hi[1]:g}{hi[0]}"
    if lo:
        return f"{kind} {'>' if lo[0] == '(' else '>='} {lo[1]:g}"
    if hi:
        return f"{kind} {'<' if hi[0] == ')' else '<='} {hi[1]:g}"
    return kind


def _lookup(schema: type, raw: Any, parts: list[str | int]) -> tuple[Any, Any, Any]:
    """(msgspec type info, raw value, the tagged union passed through last) at a path."""
    info: Any = mi.type_info(schema)
    value: Any = raw
    union: Any = None
    for part in parts:
        if isinstance(info, mi.UnionType):
            union = info
            structs = [t for t in info.types if isinstance(t, mi.StructType)]
            tag_field = structs[0].tag_field if structs else None
            tag = value.get(tag_field) if isinstance(value, dict) and tag_field else None
            info = next((t for t in structs if t.tag == tag), None)
        if isinstance(info, mi.ListType | mi.DictType) and isinstance(part, int):
            info = info.item_type if isinstance(info, mi.ListType) else info.value_type
            value = value[part] if isinstance(value, list) and part < len(value) else None
        elif isinstance(info, mi.StructType):
            info = next((f.type for f in info.fields if f.encode_name == part), None)
            value = value.get(part) if isinstance(value, dict) else None
        else:
            return None, None, union
    return info, value, union


def explain(err: msgspec.ValidationError, raw: dict[str, Any], schema: type) -> str:
    """One line for a validation error: the dotted key, what it allows, what it got."""
    m = re.match(r"^(.*?)(?: - at `\$(.*)`)?$", str(err), re.DOTALL)
    text, where = (m.group(1), m.group(2) or "") if m else (str(err), "")
    parts: list[str | int] = [
        int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"\[\d+\]|[^.\[\]]+", where)
    ]
    path = where.lstrip(".")
    join = lambda key: f"{path}.{key}" if path else key  # noqa: E731
    if u := re.match(r"Object contains unknown field `(.+)`", text):
        return f"{join(u.group(1))}: unknown key"
    if u := re.match(r"Object missing required field `(.+)`", text):
        return f"{join(u.group(1))}: missing required key"
    if parts and "Invalid value" in text:  # the tag of a tagged union (method.name, ...)
        union, _, _ = _lookup(schema, raw, parts[:-1])
        kind = str(parts[-2]) if len(parts) > 1 else "value"
        tags = ([t.tag for t in union.types if isinstance(t, mi.StructType)]
                if isinstance(union, mi.UnionType) else [])
        return (f"{path}: unknown {kind} {text.split('Invalid value ')[1]} "
                f"(choose from {', '.join(map(str, tags))})")
    if (text.startswith("Expected") and "got" not in text) or "Invalid enum value" in text:
        info, value, _ = _lookup(schema, raw, parts)
        return f"{path}: expected {_describe(info)}, got {value!r}"
    if g := re.match(r"Expected `(\w+)`.*, got `(\w+)`", text):
        return f"{path}: expected {_TYPE_NAMES.get(g.group(1), g.group(1))}, got {g.group(2)}"
    if ": " in text and not text.startswith(("Expected", "Invalid", "Object")):
        return f"{path}.{text}" if path else text  # a __post_init__ message "key: reason"
    return f"{path or '(top level)'}: {text[0].lower()}{text[1:]}"


def parse_value(text: str) -> Any:
    """A `--set` value: a TOML literal (1e-5, true, [1, 2], "x"), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. engine.replicas=2")
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise RecipeError(f"--set {key}: {p} is a value, not a section")
            node = nxt
        node[parts[-1]] = parse_value(raw.strip())
    return data


# keys that moved: an old one is refused in one line naming where it went (CHANGELOG.md)
MOVED: dict[str, str] = {
    "env.memory_mb": "env.limits.memory_mb",
    "env.cpu_seconds": "env.limits.cpu_seconds",
    "env.max_procs": "env.limits.max_procs",
    "train.weight_transport": "train.weight_sync.transport",
    "train.weight_sync_backend": "train.weight_sync.backend",
    "train.weight_bucket_mb": "train.weight_sync.bucket_mb",
    "train.weight_sync_ipc": "train.weight_sync.ipc",
    "train.weight_checksum": "train.weight_sync.checksum",
    "train.breaker_groups": "train.breaker.groups",
    "train.breaker_infra_rate": "train.breaker.infra_rate",
    "train.breaker_window": "train.breaker.window",
    "train.park_after": "train.parking.after",
    "train.park_passes": "train.parking.passes",
    "train.tail_keep": "train.tail.keep",
    "train.tail_factor": "train.tail.factor",
    "train.curriculum_steps": "train.curriculum.steps",
    "train.curriculum_floor": "train.curriculum.floor",
    "train.checkpoint_every": "train.checkpoints.every",
    "train.keep_checkpoints": "train.checkpoints.keep",
    "trainer.tensor_parallel": "trainer.megatron.tensor_parallel",
    "trainer.pipeline_parallel": "trainer.megatron.pipeline_parallel",
    "trainer.context_parallel": "trainer.megatron.context_parallel",
    "trainer.expert_parallel": "trainer.megatron.expert_parallel",
}
# the schema whose data a section's keys sit in: the whole recipe, or one section of it
_SECTION_OF: dict[type, str] = {Recipe: "", EnvSection: "env", TrainSection: "train",
                                TrainerSection: "trainer"}


def moved_key(data: dict[str, Any], schema: type) -> str:
    """The line refusing the first key of `data` that moved ("" when none did)."""
    prefix = _SECTION_OF.get(schema)
    if prefix is None:
        return ""
    for old, new in MOVED.items():
        parts = old.split(".")
        if prefix:
            if parts[0] != prefix:
                continue
            parts = parts[1:]
        node: Any = data
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and parts[-1] in node:
            return f"{old} moved to {new}"
    train = data if prefix == "train" else data.get("train") if not prefix else None
    mode = train.get("curriculum") if isinstance(train, dict) else None
    if isinstance(mode, str):  # the old flat key: curriculum = "positive-first"
        return f"train.curriculum = {mode!r} moved to train.curriculum.mode"
    return ""


def decode(data: dict[str, Any], schema: type[T]) -> T:
    """`data` as `schema`, or a RecipeError naming the first bad key."""
    if why := moved_key(data, schema):
        raise RecipeError(why)
    try:
        return msgspec.convert(data, schema)
    except msgspec.ValidationError as exc:
        raise RecipeError(explain(exc, data, schema)) from None


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except OSError as exc:
        raise RecipeError(f"{p}: cannot read the recipe ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{p}: not valid TOML: {exc}") from None


def load(path: str | Path, schema: type[T], overrides: Sequence[str] = ()) -> T:
    """Read a TOML recipe of `schema`, apply `--set` overrides, check it."""
    return decode(apply_overrides(read_toml(path), overrides), schema)


def decode_recipe(data: dict[str, Any]) -> Recipe:
    return decode(data, Recipe)


def checked(cls: type[T], **values: Any) -> T:
    """A section built from keyword values and checked like a recipe's (bounds, choices,
    unknown keys): `checked(LossSection, name="gspo")`. Plain construction skips the bounds."""
    return decode(values, cls)


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    return load(path, Recipe, overrides)
