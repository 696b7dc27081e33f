"""The `rl360 merge` recipe: one TOML file decoded into msgspec Structs with defaults and bounds.

Unknown keys and out-of-range values raise `MergeError` naming the dotted key path, e.g.
`method.density: expected a float in (0, 1], got 1.5`. Importing this module is cheap (no torch).
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

from rl360.merge.errors import MergeError

Unit = Annotated[float, Meta(gt=0, le=1)]
Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
AtLeastOne = Annotated[float, Meta(ge=1)]
Scope = Literal["model", "tensor"]
DEFAULT_AVERAGE = ["embed_tokens", "lm_head", "wte", "wpe"]


class _Method(Struct, forbid_unknown_fields=True, tag_field="name", kw_only=True):
    pass


class Soup(_Method, tag="soup"):
    """Weighted uniform soup: sum w_i theta_i / sum w_i."""


class GreedySoup(_Method, tag="greedy_soup"):
    """Greedy soup (Wortsman et al.): an `rl360 eval` recipe scores each candidate soup."""

    evaluator: str
    metric: str = "mean_reward"


class TaskArithmetic(_Method, tag="task_arithmetic"):
    lam: float = field(default=1.0, name="lambda")
    normalize: bool = False


class Ties(_Method, tag="ties"):
    """TIES: density is the kept fraction K; scope "model" is the paper's global trim."""

    density: Unit = 0.2
    scope: Scope = "model"
    lam: float = field(default=1.0, name="lambda")


class DareLinear(_Method, tag="dare_linear"):
    """DARE + task arithmetic. density = keep probability = 1 - p."""

    density: Unit = 0.5
    rescale: Literal["paper", "l1", "none"] = "paper"
    seed: Annotated[int, Meta(ge=0)] = 0
    lam: float = field(default=1.0, name="lambda")


class DareTies(DareLinear, tag="dare_ties"):
    """DARE + TIES sign election and disjoint mean (normalize=false: mergekit's sum)."""

    normalize: bool = True


class Ram(_Method, tag="ram"):
    epsilon: NonNegative = 1e-5


class RamPlus(Ram, tag="ram_plus"):
    """RAM+: lambda_j = 1 + (rescale_factor - 1) * min(alpha, S_j / U_j) on unique entries.

    Official: rescale_factor 1.2, alpha 1, scope "model"; mergekit ramplus_tl defaults:
    rescale_factor 1.1, alpha 0.2, scope "tensor"."""

    rescale_factor: AtLeastOne = 1.2
    alpha: Positive = 1.0
    scope: Scope = "model"


class UlpGate(_Method, tag="ulp_gate"):
    """ULP-gate (spec section 7): an expert is active where it moved >= gate bf16 steps."""

    gate: Annotated[int, Meta(ge=1)] = 1
    rescale_factor: AtLeastOne = 1.0
    alpha: Positive = 1.0
    scope: Scope = "model"
    policy: Literal["fp32", "report", "snap"] = "fp32"


class GramSoup(_Method, tag="gram_soup"):
    lam: float = field(default=1.0, name="lambda")


class ModelStock(_Method, tag="model_stock"):
    pass


class IsoC(_Method, tag="iso_c"):
    alpha: Positive = 1.0
    average: list[str] = field(default_factory=lambda: list(DEFAULT_AVERAGE))


class IsoCts(IsoC, tag="iso_cts"):
    common_space_fraction: Unit = 0.8


MethodConfig = (
    Soup
    | GreedySoup
    | TaskArithmetic
    | Ties
    | DareLinear
    | DareTies
    | Ram
    | RamPlus
    | UlpGate
    | GramSoup
    | ModelStock
    | IsoC
    | IsoCts
)
METHOD_NAMES = (
    "soup", "greedy_soup", "task_arithmetic", "ties", "dare_linear", "dare_ties", "ram",
    "ram_plus", "ulp_gate", "gram_soup", "model_stock", "iso_c", "iso_cts",
)  # fmt: skip


class Expert(Struct, forbid_unknown_fields=True):
    path: str
    weight: float = 1.0
    name: str | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.weight):
            raise ValueError("weight: expected a finite float")

    @property
    def label(self) -> str:
        return self.name or Path(self.path).name


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """'500MB' -> 500_000_000, '2GiB' -> 2**31, '1024' -> 1024 bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"expected a size like '2GB' or '500MB', got {text!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


class Output(Struct, forbid_unknown_fields=True):
    dir: str
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_shard_size: str = "4GB"
    overwrite: bool = False

    def __post_init__(self) -> None:
        try:
            if parse_size(self.max_shard_size) < 1:
                raise ValueError("expected a size of at least 1 byte")
        except ValueError as e:
            raise ValueError(f"max_shard_size: {e}") from None


class Run(Struct, forbid_unknown_fields=True):
    ray: bool = False
    progress: bool = True
    chunk_elements: Annotated[int, Meta(ge=1024)] = 1 << 18
    reader: Literal["pread", "safetensors"] = "pread"


class Recipe(Struct, forbid_unknown_fields=True):
    base: str
    experts: Annotated[list[Expert], Meta(min_length=1)]
    method: MethodConfig
    output: Output
    run: Run = field(default_factory=Run)


_TYPE_NAMES = {"float": "a float", "int": "an int", "str": "a string", "bool": "a boolean",
               "array": "a list", "object": "a table"}  # fmt: skip


def _describe(info: Any) -> str:
    """'a float in (0, 1]', 'an int >= 1', "one of 'a', 'b'" from msgspec type info."""
    from msgspec import inspect as mi

    if isinstance(info, mi.LiteralType):
        return "one of " + ", ".join(repr(v) for v in info.values)
    if isinstance(info, mi.ListType) and info.min_length:
        return f"a list of at least {info.min_length} item(s)"
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


def _lookup(raw: Any, parts: list[str | int]) -> tuple[Any, Any]:
    """(msgspec type info, raw value) at a path of the recipe, choosing the method by its tag."""
    from msgspec import inspect as mi

    info: Any = mi.type_info(Recipe)
    value: Any = raw
    for part in parts:
        if isinstance(info, mi.UnionType):
            tag = value.get("name") if isinstance(value, dict) else None
            info = next((t for t in info.types if getattr(t, "tag", None) == tag), None)
        if isinstance(info, mi.ListType) and isinstance(part, int):
            info = info.item_type
            value = value[part] if isinstance(value, list) and part < len(value) else None
        elif isinstance(info, mi.StructType):
            info = next((f.type for f in info.fields if f.encode_name == part), None)
            value = value.get(part) if isinstance(value, dict) else None
        else:
            return None, None
    return info, value


def _format_error(err: msgspec.ValidationError, raw: dict[str, Any]) -> str:
    msg = str(err)
    m = re.match(r"^(.*?)(?: - at `\$(.*)`)?$", msg, re.DOTALL)
    text, where = (m.group(1), m.group(2) or "") if m else (msg, "")
    parts: list[str | int] = [
        int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"\[\d+\]|[^.\[\]]+", where)
    ]
    path = where.lstrip(".")
    join = lambda key: f"{path}.{key}" if path else key  # noqa: E731
    if u := re.match(r"Object contains unknown field `(.+)`", text):
        return f"{join(u.group(1))}: unknown key"
    if u := re.match(r"Object missing required field `(.+)`", text):
        return f"{join(u.group(1))}: missing required key"
    if parts and parts[-1] == "name" and parts[:1] == ["method"] and "Invalid value" in text:
        return f"method.name: unknown method {text.split('Invalid value ')[1]} (choose from {', '.join(METHOD_NAMES)})"
    if (text.startswith("Expected") and "got" not in text) or "Invalid enum value" in text:
        info, value = _lookup(raw, parts)
        return f"{path}: expected {_describe(info)}, got {value!r}"
    if g := re.match(r"Expected `(\w+)`.*, got `(\w+)`", text):
        return f"{path}: expected {_TYPE_NAMES.get(g.group(1), g.group(1))}, got {g.group(2)}"
    if path and ": " in text and not text.startswith(("Expected", "Invalid", "Object")):
        return f"{path}.{text}"  # a __post_init__ message "key: reason"
    return f"{path or '<recipe>'}: {text[0].lower()}{text[1:]}"


def parse_recipe(raw: dict[str, Any]) -> Recipe:
    """Validate a recipe given as a dict (e.g. a parsed TOML table)."""
    try:
        return msgspec.convert(raw, Recipe)
    except msgspec.ValidationError as e:
        raise MergeError(_format_error(e, raw)) from None


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply `dotted.key=value` to a raw recipe; the value is TOML (a bare word is a string)."""
    key, sep, text = assignment.partition("=")
    if not sep or not key.strip():
        raise MergeError(f"--set {assignment}: expected key=value")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise MergeError(f"--set {assignment}: {part} is not a table")
    node[parts[-1]] = value


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read and validate a merge recipe TOML file, after `key=value` overrides."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except OSError as e:
        raise MergeError(f"{p}: cannot read the recipe ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise MergeError(f"{p}: invalid TOML ({e})") from None
    for assignment in overrides:
        apply_override(raw, assignment)
    return parse_recipe(raw)
