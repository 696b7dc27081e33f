"""The `rl360 merge` recipe: one TOML file decoded into msgspec Structs with defaults and bounds.

Unknown keys and out-of-range values raise `MergeError` naming the dotted key path, e.g.
`method.density: expected a float in (0, 1], got 1.5`. Importing this module is cheap (no torch).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct, field

from rl360.merge.errors import MergeError
from rl360.recipe import RecipeError, decode, load

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


def parse_recipe(raw: dict[str, Any]) -> Recipe:
    """Validate a recipe given as a dict (e.g. a parsed TOML table)."""
    try:
        return decode(raw, Recipe)
    except RecipeError as e:
        raise MergeError(str(e)) from None


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read and validate a merge recipe TOML file, after `key=value` overrides (the project's
    one recipe loader: same TOML reading, `--set` syntax and error lines)."""
    try:
        return load(path, Recipe, overrides)
    except RecipeError as e:
        raise MergeError(str(e)) from None
