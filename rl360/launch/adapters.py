"""`trainer.lora` before a run: `rl360 recipe check` validates the adapter targets against the
model's decoder-layer projections, `rl360 plan` prints what adapters change in memory and in a
weight version, and `engine_for` gives the engine section vLLM / SGLang start with.

A Llama-shaped model's projections come from its config.json alone (no torch); any other
model is built from its config on the meta device. A model that is not on this machine is not
checked here (the trainer refuses bad targets at start-up with the same message).

Memory per trainer rank (activations not counted; fp32 master weights, AdamW's two moments):
full fine-tuning holds 16 bytes a parameter (weights, gradients, moments); with adapters the
frozen base holds 4 and the adapter 16 a parameter of its own. A torch engine replica merges
each adapter version into its weights and keeps the base of every adapted weight (a second copy
of those weights, model.dtype; rl360.serve.engines.torch_adapter); vLLM and SGLang hold the
adapter beside the base. A weight version carries the adapter alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from rl360.recipe import EngineSection, LoraSection, Recipe, RecipeError
from rl360.serve.engines.support import adapter_options

LLAMA_SHAPED = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_TRAINER_BYTES = {"full": 16, "frozen": 4}  # per parameter, see the module docstring


def _local_config(recipe: Recipe) -> Path | None:
    """The model's directory when it is on this machine (built-in models resolved, and built
    on first use), else None."""
    path = recipe.model.path
    if path == "tiny" or path.startswith("tiny:") or path == "smollm2":
        from rl360.policies.loading import ModelNotFound, resolve_model_path

        try:
            return resolve_model_path(path)
        except ModelNotFound:
            return None
    p = Path(path).expanduser()
    return p if (p / "config.json").is_file() else None


def projection_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Every Linear of the decoder layers, by qualified name: (out features, in features)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") in LLAMA_SHAPED and cfg.get("num_hidden_layers"):
        h, i = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        d = int(cfg.get("head_dim") or h // heads)
        per = {"self_attn.q_proj": (heads * d, h), "self_attn.k_proj": (kv * d, h),
               "self_attn.v_proj": (kv * d, h), "self_attn.o_proj": (h, heads * d),
               "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
        return {f"model.layers.{n}.{k}": v for n in range(int(cfg["num_hidden_layers"]))
                for k, v in per.items()}
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl360.policies.lora import layer_linears

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return {n: (m.out_features, m.in_features) for n, m in layer_linears(model).items()}


def check_lora_targets(recipe: Recipe) -> None:
    """RecipeError naming the first `trainer.lora.targets` entry that is no projection of the
    model's decoder layers (nothing to check without adapters or without the model here)."""
    lora = recipe.trainer.lora
    model_dir = _local_config(recipe) if lora is not None else None
    if lora is None or model_dir is None:
        return
    have = sorted({n.rsplit(".", 1)[-1] for n in projection_shapes(model_dir)})
    for t in lora.targets:
        if t not in have:
            raise RecipeError(f"trainer.lora.targets: {t!r} is not a linear projection of the "
                              f"model's decoder layers (they have: {', '.join(have)})")


def adapter_params(lora: LoraSection, shapes: dict[str, tuple[int, int]]) -> int:
    return sum(lora.rank * (o + i) for n, (o, i) in shapes.items()
               if n.rsplit(".", 1)[-1] in lora.targets)


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def memory_lines(recipe: Recipe) -> list[str]:
    """The plan's `adapters` lines: adapter size, trainer and engine memory, version bytes."""
    lora = recipe.trainer.lora
    if lora is None:
        return []
    head = (f"adapters  rank {lora.rank}, alpha {lora.alpha:g} on "
            f"{', '.join(lora.targets)}")
    model_dir = _local_config(recipe)
    if model_dir is None:
        return [head + " (model not on this machine: sizes unknown)"]
    from rl360.launch.throughput import _bytes_per_param, model_size

    shapes = projection_shapes(model_dir)
    n_adapter = adapter_params(lora, shapes)
    total, _, _ = model_size(recipe)
    t = recipe.trainer
    shard = t.workers if t.backend == "fsdp" else 1
    full = total * _TRAINER_BYTES["full"] / shard
    with_lora = (total * _TRAINER_BYTES["frozen"] + n_adapter * _TRAINER_BYTES["full"]) / shard
    dtype = _bytes_per_param(recipe.model.dtype)
    adapted = sum(o * i for n, (o, i) in shapes.items() if n.rsplit(".", 1)[-1] in lora.targets)
    engine_extra = (adapted + n_adapter if recipe.engine.backend == "torch" else n_adapter) * dtype
    what = ("the adapted weights' base and the adapter" if recipe.engine.backend == "torch"
            else "adapter")
    return [
        f"{head}: {n_adapter / 1e6:.2f}M parameters ({n_adapter / max(total, 1):.1%} of "
        f"{total / 1e6:.1f}M)",
        f"memory    trainer rank {_mb(with_lora)} of weights, gradients and AdamW state "
        f"(full fine-tuning {_mb(full)}; activations not counted); engine replica + "
        f"{_mb(engine_extra)} ({what}) beside {_mb(total * dtype)} of weights",
        f"versions  {_mb(n_adapter * dtype)} of adapter a weight version against "
        f"{_mb(total * dtype)} full ({total / max(n_adapter, 1):.1f}x fewer bytes)",
    ]


def engine_for(recipe: Recipe) -> EngineSection:
    """recipe.engine with the options its backend needs at start to serve trainer.lora's
    adapter versions (vLLM, SGLang: rl360.serve.engines.support.adapter_options); options the
    recipe sets itself win."""
    lora = recipe.trainer.lora
    if lora is None:
        return recipe.engine
    extra = adapter_options(recipe.engine.backend, lora.rank, list(lora.targets))
    if not extra:
        return recipe.engine
    return msgspec.structs.replace(recipe.engine, options={**extra, **recipe.engine.options})


def version_params(recipe: Recipe) -> float:
    """Parameters a weight version carries with trainer.lora (the adapter's; 0: no adapters,
    or the model is not here to count them)."""
    lora = recipe.trainer.lora
    model_dir = _local_config(recipe) if lora is not None else None
    if lora is None or model_dir is None:
        return 0.0
    return float(adapter_params(lora, projection_shapes(model_dir)))
