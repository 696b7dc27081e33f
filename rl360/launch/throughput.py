"""Throughput figures for `rl360 plan --estimate`: per-backend defaults (each with its source),
`--throughput KEY=VALUE` overrides, and refinement from a run's own metrics.jsonl.

Figures (all per step of the recipe's workload):
  engine_tokens_per_s   generated tokens per second per engine replica, the whole rollout
                        pipeline included (session server, env actors, sandboxes)
  trainer_tokens_per_s  trained (loss-masked) tokens per second per trainer rank
  sync_s                seconds to publish one version to every engine (0 = from the model size)
  sync_gb_per_s         weight-sync bandwidth when sync_s = 0
  tokens_per_episode    generated tokens per episode, all turns
  seq_tokens_per_s      decode speed of one sequence (0: no bound); an episode cannot finish
                        faster than tokens_per_episode / seq_tokens_per_s
  params / active_params  model size (active: per token, for a mixture of experts)

GPU defaults are rooflines, not measurements (no GPU was lent to this project yet): a decode
step reads the weights once (memory bound, H100-class 3.35 TB/s at 50% efficiency) and does
2 x active_params FLOPs per token (989 TFLOP/s bf16 at 40%); training does 6 x active_params
FLOPs per token over prompt and completion (assumed as long as the completion) at 35% MFU
(FSDP, Megatron) or 25% (replicated torch). Replace them with `--metrics` from a real run.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

import msgspec

from rl360.recipe import Recipe

HBM_BYTES_PER_S = 3.35e12  # H100 SXM
BF16_FLOPS = 989e12  # H100 SXM dense
MEM_EFF, DECODE_EFF = 0.5, 0.4
MFU = {"fsdp": 0.35, "megatron": 0.35, "torch": 0.25}
ENGINE_EFF = {"sglang": 1.0, "vllm": 1.0, "torch": 0.2}  # HF generate() is far from a roofline

# a measured CPU demo run (2-core VM, quiet): 959 generated tok/s through the whole pipeline
# with one torch replica, ~21 tokens an episode (959 tok/s x 5.6 s / 256 episodes), 0.3 s of
# training a step; `--metrics` replaces these with a run's own figures
CPU_ENGINE_TOKENS_PER_S = 959.0
CPU_TRAINER_TOKENS_PER_S = 959.0 * 5.6 / 0.3
CPU_SOURCE = "a measured CPU demo run (2-core VM)"


class Figures(msgspec.Struct, kw_only=True):
    engine_tokens_per_s: float
    trainer_tokens_per_s: float
    sync_s: float = 0.0
    sync_gb_per_s: float = 1.0
    tokens_per_episode: float = 0.0
    seq_tokens_per_s: float = 0.0
    params: float = 0.0
    active_params: float = 0.0
    sources: dict[str, str] = msgspec.field(default_factory=dict)


class EstimateError(ValueError):
    """Bad --throughput / --metrics input; one line naming it."""


def _bytes_per_param(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def model_size(recipe: Recipe) -> tuple[float, float, str]:
    """(params, active params, where from): the HF config when the model is here, else the
    size in its name ("Qwen3-8B", "Qwen3-30B-A3B"), else (0, 0)."""
    path = recipe.model.path
    local = path == "tiny" or path.startswith("tiny:") or path == "smollm2" or \
        (Path(path).expanduser() / "config.json").is_file()
    if local:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from rl360.policies.loading import resolve_model_path

        cfg = AutoConfig.from_pretrained(resolve_model_path(path))
        with torch.device("meta"):
            n = float(sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters()))
        return n, n, "the model's config"
    m = re.search(r"(\d+(?:\.\d+)?)B(?:-A(\d+(?:\.\d+)?)B)?", Path(path).name, re.I)
    if m:
        total = float(m.group(1)) * 1e9
        return total, float(m.group(2)) * 1e9 if m.group(2) else total, "the model's name"
    return 0.0, 0.0, "unknown (set --throughput params=...)"


def concurrency(recipe: Recipe) -> int:
    """Episodes in flight at once: env slots, capped by the controller's in-flight groups."""
    env = recipe.env.actors * recipe.env.episodes_per_actor
    return max(1, min(env, recipe.train.max_in_flight_groups * recipe.train.group_size))


def default_figures(recipe: Recipe) -> Figures:
    e, t = recipe.engine, recipe.trainer
    params, active, size_src = model_size(recipe)
    sampling = recipe.train.sampling
    f = Figures(engine_tokens_per_s=0.0, trainer_tokens_per_s=0.0, params=params,
                active_params=active,
                tokens_per_episode=sampling.max_tokens / 2,
                sources={"params": size_src,
                         "tokens_per_episode": "prior: half of train.sampling.max_tokens"})
    if e.num_gpus > 0 and active > 0:
        batch = max(1, min(e.max_batch_size, concurrency(recipe) // e.replicas))
        weights = params * _bytes_per_param(recipe.model.dtype) / e.tensor_parallel
        step_s = max(weights / (HBM_BYTES_PER_S * MEM_EFF),
                     2 * active * batch / (e.tensor_parallel * BF16_FLOPS * DECODE_EFF))
        eff = ENGINE_EFF.get(e.backend, 1.0)
        f.engine_tokens_per_s = batch / step_s * eff
        f.seq_tokens_per_s = eff / step_s
        f.sources["engine_tokens_per_s"] = (f"decode roofline, {batch} sequences a replica, TP "
                                            f"{e.tensor_parallel} (H100-class assumptions)")
    else:
        f.engine_tokens_per_s = CPU_ENGINE_TOKENS_PER_S
        f.sources["engine_tokens_per_s"] = CPU_SOURCE
    if t.num_gpus > 0 and active > 0:
        f.trainer_tokens_per_s = (BF16_FLOPS * MFU.get(t.backend, 0.25) * t.num_gpus
                                  / (6 * active * 2))  # x2: a prompt as long as the completion
        f.sources["trainer_tokens_per_s"] = f"6N FLOPs/token at {MFU.get(t.backend, 0.25):.0%} MFU"
        f.sync_gb_per_s = 20.0  # NCCL broadcast across nodes, bucketed
        f.sources["sync"] = "20 GB/s (NCCL over the cluster network, assumed)"
    else:
        f.trainer_tokens_per_s = CPU_TRAINER_TOKENS_PER_S
        f.sources["trainer_tokens_per_s"] = CPU_SOURCE
        f.sources["sync"] = "1 GB/s (Ray object store on one machine, assumed)"
    return f


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def refine(f: Figures, recipe: Recipe, metrics: str | Path, skip: int = 1) -> int:
    """Replace the figures with what a run of (a recipe like) this one measured; returns the
    rows used. The first `skip` rows (warm-up: compilation, caches) are left out."""
    path = Path(metrics)
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        raise EstimateError(f"--metrics {str(path)!r}: cannot read it as JSON lines ({exc})") from None
    need = ("step_s", "wait_s", "train_s", "sync_s", "gen_tokens_per_s", "episodes")
    rows = [r for r in rows if all(isinstance(r.get(k), int | float) for k in need)]
    rows = rows[skip:] if len(rows) > skip else rows
    if not rows:
        raise EstimateError(f"--metrics {str(path)!r}: no rows with {', '.join(need)}")
    sync = recipe.train.max_staleness == 0
    gen, tpe, eng, trn = [], [], [], []
    for r in rows:
        tokens = r["gen_tokens_per_s"] * r["step_s"]
        gen.append(tokens)
        if r["episodes"]:
            tpe.append(tokens / r["episodes"])
        # synchronous: engines work while the trainer waits; async: all the time they are busy
        idle = r.get("engine_idle_frac")
        busy = r["wait_s"] if sync else r["step_s"] * (1 - idle if isinstance(idle, float)
                                                         and math.isfinite(idle) else 1.0)
        if busy > 0:
            eng.append(tokens / busy / recipe.engine.replicas)
        if r["train_s"] > 0:
            trn.append(tokens / r["train_s"] / recipe.trainer.workers)
    where = f"{path.name} ({len(rows)} steps)"
    f.tokens_per_episode = _median(tpe)
    f.engine_tokens_per_s = _median(eng)
    f.trainer_tokens_per_s = _median(trn)
    f.sync_s = _median([r["sync_s"] for r in rows])
    f.seq_tokens_per_s = 0.0  # the measured rate already includes it
    for k in ("tokens_per_episode", "engine_tokens_per_s", "trainer_tokens_per_s", "sync"):
        f.sources[k] = where
    return len(rows)


_KEYS = ("engine_tokens_per_s", "trainer_tokens_per_s", "sync_s", "sync_gb_per_s",
         "tokens_per_episode", "seq_tokens_per_s", "params", "active_params")


def override(f: Figures, items: list[str]) -> None:
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        try:
            if not sep or key not in _KEYS:
                raise ValueError
            value = float(raw)
            if not math.isfinite(value) or value < 0:
                raise ValueError
        except ValueError:
            raise EstimateError(f"--throughput {item!r}: expected KEY=NUMBER >= 0 with KEY one "
                                f"of {', '.join(_KEYS)}") from None
        setattr(f, key, value)
        if key == "params" and not any(i.startswith("active_params=") for i in items):
            f.active_params = value
        f.sources["sync" if key.startswith("sync") else key] = "--throughput"


def figures_for(recipe: Recipe, metrics: str = "", items: list[str] | None = None) -> Figures:
    f = default_figures(recipe)
    if metrics:
        refine(f, recipe, metrics)
    override(f, items or [])
    return f


def as_dict(f: Figures) -> dict[str, Any]:
    return msgspec.to_builtins(f)
