"""Does the recipe ask its backends for something they can run? One line per problem.

    problems = support_problems(recipe)   # ["trainer.megatron.pipeline_parallel=2: ...", ...]

Reads each backend's own declaration (ENGINE_SUPPORT, TRAINER_SUPPORT: devices, dtypes, model
families, parallel layouts) and names the recipe key and what the backend supports. Used by
`rl360 plan` (fails before planning) and `rl360 preflight` (the "support" check). Starts
nothing and imports nothing heavy.
"""

from __future__ import annotations

import json
from pathlib import Path

from rl360.policies.support import TRAINER_SUPPORT
from rl360.recipe import Recipe
from rl360.serve.engines.support import ENGINE_SUPPORT
from rl360.types import MOE_FAMILIES, BackendSupport

_PARALLEL = ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel")


def model_family(recipe: Recipe) -> tuple[str | None, str]:
    """(HF model_type or None when unknown, where it came from). A `model.family` that
    disagrees with the model's config.json is an error (ValueError naming both)."""
    m = recipe.model
    path = m.path
    built_in = path == "tiny" or path.startswith("tiny:") or path == "smollm2"
    found: str | None = "llama" if built_in else None  # both are LlamaForCausalLM
    where = f"model.path {path!r}"
    config = Path(path).expanduser() / "config.json"
    if found is None and config.is_file():
        try:
            found = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError):
            found = None
        where = f"{config}"
    if m.family != "auto":
        if found is not None and found != m.family:
            raise ValueError(f"model.family={m.family!r} but {where} is {found!r}: fix "
                             "model.family (or set it to 'auto')")
        return m.family, "model.family"
    return found, where


def _parallel_text(s: BackendSupport) -> str:
    parts = [f"{k}<={getattr(s, k)}" for k in _PARALLEL if getattr(s, k) > 1]
    return ", ".join(parts) or "data parallel only"


def _check(section: str, s: BackendSupport, device: str, dtype_key: str, dtype: str,
           sizes: dict[str, int], family: str | None, remote: bool,
           sizes_key: str = "") -> list[str]:
    """`sizes_key`: where the recipe holds the parallel sizes (`section` by default)."""
    who = f"the {s.backend!r} {section} backend"
    sizes_key = sizes_key or section
    out = []
    if not remote and device not in s.devices:
        gpus_key = f"{section}.num_gpus"
        want = "> 0" if device == "cpu" else "= 0"
        out.append(f"{gpus_key}: {who} runs on {'/'.join(s.devices)} only, this recipe puts it "
                   f"on {device} (set {gpus_key} {want} or pick another {section}.backend)")
    if dtype not in s.dtypes:
        out.append(f"{dtype_key}={dtype!r}: {who} supports {', '.join(s.dtypes)}")
    for key, size in sizes.items():
        if size > getattr(s, key):
            out.append(f"{sizes_key}.{key}={size}: {who} supports {_parallel_text(s)}"
                       + (f" ({s.notes})" if s.notes else ""))
    if family is not None:
        if family in MOE_FAMILIES and not s.moe:
            out.append(f"model.family={family!r} is a mixture of experts: {who} supports dense "
                       "models only" + (f" ({', '.join(s.families)})" if s.families else ""))
        elif s.families and family not in s.families:
            out.append(f"model.family={family!r}: {who} supports model families "
                       f"{', '.join(s.families)}")
    ep = sizes.get("expert_parallel", 1)
    if ep > 1 and family is not None and family not in MOE_FAMILIES:
        out.append(f"{sizes_key}.expert_parallel={ep}: model family {family!r} has no experts "
                   "(set it to 1)")
    return out


def support_problems(recipe: Recipe) -> list[str]:
    """Every way the recipe asks its engine or trainer backend for what it does not support."""
    try:
        family, _ = model_family(recipe)
    except ValueError as exc:
        return [str(exc)]
    e, t = recipe.engine, recipe.trainer
    out: list[str] = []
    es = ENGINE_SUPPORT.get(e.backend)
    if es is None:
        out.append(f"engine.backend={e.backend!r}: no support declaration (known: "
                   f"{', '.join(sorted(ENGINE_SUPPORT))})")
    else:
        remote = bool(es.remote_option and e.options.get(es.remote_option))
        out += _check("engine", es, "cuda" if e.num_gpus > 0 else "cpu", "model.dtype",
                      recipe.model.dtype, {"tensor_parallel": e.tensor_parallel,
                                           "expert_parallel": e.expert_parallel}, family, remote)
    ts = TRAINER_SUPPORT.get(t.backend)
    if ts is None:
        out.append(f"trainer.backend={t.backend!r}: no support declaration (known: "
                   f"{', '.join(sorted(TRAINER_SUPPORT))})")
    else:
        out += _check("trainer", ts, "cuda" if t.num_gpus > 0 else "cpu", "trainer.dtype",
                      t.dtype, {k: getattr(t.megatron, k) for k in _PARALLEL}, family, False,
                      "trainer.megatron")
    return out


def support_summary(recipe: Recipe) -> str:
    """One line for a recipe that passes: the backends and the model family checked."""
    try:
        family, where = model_family(recipe)
    except ValueError as exc:
        return str(exc)
    fam = f"model family {family!r} (from {where})" if family else \
        f"model family unknown ({where} has no config.json here; set model.family)"
    return (f"engine {recipe.engine.backend!r} and trainer {recipe.trainer.backend!r} support "
            f"this layout, dtype and device; {fam}")
