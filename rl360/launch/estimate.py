"""`rl360 plan --estimate`: generation, training, weight-sync and step time of one step of the
recipe on the planned cluster, the bottleneck role, and the GPU split that would balance it.

    est = estimate(recipe, figures_for(recipe, metrics="runs/x/metrics.jsonl"))

The model (per step, workload = train.groups_per_batch x train.group_size episodes):
  generation = episodes x tokens_per_episode / (engine.replicas x engine_tokens_per_s), and
               no less than one episode's tokens at one sequence's decode speed
  training   = the same tokens / (trainer.workers x trainer_tokens_per_s)
  weight sync = the measured sync_s, else model bytes (with trainer.lora the adapter's) / sync
               bandwidth (every sync_every steps); for full weights, rl360.weights.sizing's
               model of the path the recipe takes: the full gather (fsdp and megatron ranks
               gather, rank 0 sends) or sharded senders (train.weight_sync.sharded); both are
               printed, with a version's bytes and a sending rank's extra memory
  step       = generation + training + sync when train.max_staleness = 0 (synchronous);
               else the slower of generation and training + sync (they overlap)
Balance: GPU-seconds of rollout vs of training; the split of the same GPUs that makes them
equal, rounded to whole engine replicas and trainer ranks.
"""

from __future__ import annotations

import msgspec

from rl360.launch.adapters import version_params
from rl360.launch.throughput import Figures, _bytes_per_param
from rl360.recipe import CollectiveSync, Recipe
from rl360.weights.sizing import SyncCost, sync_cost


class Estimate(msgspec.Struct, kw_only=True):
    episodes: int
    gen_tokens: float
    generation_s: float
    training_s: float
    sync_s: float
    step_s: float
    mode: str  # "synchronous" | "overlapped"
    bottleneck: str  # "rollout" | "training" | "weight sync"
    engine_gpus: float
    trainer_gpus: float
    balanced_engine_replicas: int = 0
    balanced_trainer_workers: int = 0
    balanced_step_s: float = 0.0
    figures: Figures | None = None
    sync_cost: SyncCost | None = None  # a full-weight version on paper (rl360.weights.sizing)
    sharded: bool = False  # the recipe's sync is sharded (train.weight_sync.sharded)


def is_sharded(recipe: Recipe) -> bool:
    sync = recipe.train.weight_sync
    return isinstance(sync, CollectiveSync) and sync.sharded


def cost_of(recipe: Recipe, f: Figures) -> SyncCost | None:
    """A full-weight version of the recipe on paper (None for adapter versions or an unknown
    model size): the ranks that gather for the full-gather path are fsdp's W and megatron's
    tensor-parallel peers; a torch rank holds the whole model."""
    if version_params(recipe) or f.params <= 0:
        return None
    t, sync = recipe.trainer, recipe.train.weight_sync
    gather = {"fsdp": t.workers, "megatron": t.megatron.tensor_parallel}.get(t.backend, 1)
    bucket_mb = sync.bucket_mb if isinstance(sync, CollectiveSync) else 512.0
    return sync_cost(f.params, t.workers, recipe.model.dtype, "float32", bucket_mb,
                     f.sync_gb_per_s, gather_ways=gather)


def _sync_s(recipe: Recipe, f: Figures, cost: SyncCost | None) -> float:
    if f.sync_s > 0:
        per = f.sync_s
    elif cost is not None:
        per = cost.sharded_s if is_sharded(recipe) else cost.full_gather_s
    else:  # with trainer.lora a version is the adapter alone
        params = version_params(recipe) or f.params
        per = params * _bytes_per_param(recipe.model.dtype) / (f.sync_gb_per_s * 1e9)
    return per / recipe.train.sync_every


def _step(mode: str, gen: float, train: float, sync: float) -> float:
    return gen + train + sync if mode == "synchronous" else max(gen, train + sync)


def estimate(recipe: Recipe, f: Figures) -> Estimate:
    e, t, tr = recipe.engine, recipe.trainer, recipe.train
    episodes = tr.groups_per_batch * tr.group_size
    tokens = episodes * f.tokens_per_episode
    gen = tokens / max(e.replicas * f.engine_tokens_per_s, 1e-12)
    if f.seq_tokens_per_s > 0:
        gen = max(gen, f.tokens_per_episode / f.seq_tokens_per_s)
    train = tokens / max(t.workers * f.trainer_tokens_per_s, 1e-12)
    cost = cost_of(recipe, f)
    sync = _sync_s(recipe, f, cost)
    mode = "synchronous" if tr.max_staleness == 0 else "overlapped"
    step = _step(mode, gen, train, sync)
    if gen >= train + sync:
        neck = "rollout"
    else:
        neck = "weight sync" if sync > train else "training"
    est = Estimate(episodes=episodes, gen_tokens=tokens, generation_s=gen, training_s=train,
                   sync_s=sync, step_s=step, mode=mode, bottleneck=neck,
                   engine_gpus=e.replicas * e.num_gpus, trainer_gpus=t.workers * t.num_gpus,
                   figures=f, sync_cost=cost, sharded=is_sharded(recipe))
    _balance(est, recipe)
    return est


def _balance(est: Estimate, recipe: Recipe) -> None:
    """The split of the same GPUs that equalises rollout and training GPU-seconds."""
    e, t = recipe.engine, recipe.trainer
    if e.num_gpus <= 0 or t.num_gpus <= 0:
        return
    total = est.engine_gpus + est.trainer_gpus
    gen_work = est.generation_s * est.engine_gpus
    train_work = est.training_s * est.trainer_gpus
    if gen_work + train_work <= 0:
        return
    f = est.figures
    floor = f.tokens_per_episode / f.seq_tokens_per_s if f and f.seq_tokens_per_s > 0 else 0.0
    mp = t.megatron.tensor_parallel * t.megatron.pipeline_parallel * t.megatron.context_parallel if t.backend == "megatron" \
        else 1
    best: tuple[float, int, int] | None = None
    for replicas in range(1, int(total // e.num_gpus) + 1):
        workers = int((total - replicas * e.num_gpus) // t.num_gpus) // mp * mp
        if workers < mp:
            continue
        gen = max(gen_work / (replicas * e.num_gpus), floor)
        train = train_work / (workers * t.num_gpus)
        step = _step(est.mode, gen, train, est.sync_s)
        if best is None or step < best[0]:
            best = (step, replicas, workers)
    if best is not None:
        est.balanced_step_s, est.balanced_engine_replicas, est.balanced_trainer_workers = best


def _s(x: float) -> str:
    return f"{x:.3g} s" if x < 10 else f"{x:,.0f} s"


def _b(x: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if x >= size:
            return f"{x / size:.3g} {unit}"
    return f"{x:,.0f} B"


def _sync_lines(est: Estimate, recipe: Recipe) -> list[str]:
    """A full-weight version on paper: bytes, the link assumed, both paths' time per version
    and a sending rank's extra memory (the recipe's path marked)."""
    c = est.sync_cost
    if c is None:
        return []
    t = recipe.trainer
    mine = ("sharded", "full gather") if est.sharded else ("full gather", "sharded")
    paths = {"full gather": f"full gather {_s(c.full_gather_s)} a version, rank 0's extra "
                            f"memory {_b(c.full_gather_peak_bytes)}",
             "sharded": f"sharded {_s(c.sharded_s)} a version, each of {t.workers} ranks' "
                        f"extra memory <= {_b(c.rank_peak_bytes)} (its {_b(c.shard_bytes)} "
                        f"shard + a {_b(c.bucket_bytes)} bucket)"}
    return [f"    version    {_b(c.version_bytes)} ({recipe.model.dtype}) over "
            f"{c.link_gb_per_s:g} GB/s a link (assumed)",
            f"    this path  {paths[mine[0]]}",
            f"    other      {paths[mine[1]]}"]


def render_estimate(est: Estimate, recipe: Recipe) -> list[str]:
    f = est.figures
    assert f is not None
    e, t = recipe.engine, recipe.trainer
    src = f.sources
    lines = ["estimate  (one step; figures and their sources below)",
             f"  workload     {est.episodes} episodes x {f.tokens_per_episode:,.0f} tokens = "
             f"{est.gen_tokens:,.0f} generated tokens",
             f"  generation   {_s(est.generation_s)}  ({e.replicas} x {e.backend} replica at "
             f"{f.engine_tokens_per_s:,.0f} tok/s)",
             f"  training     {_s(est.training_s)}  ({t.workers} x {t.backend} rank at "
             f"{f.trainer_tokens_per_s:,.0f} tok/s)",
             f"  weight sync  {_s(est.sync_s)}",
             *_sync_lines(est, recipe),
             f"  step         {_s(est.step_s)}  ({est.mode}: " + (
                 "generation + training + sync)" if est.mode == "synchronous"
                 else "the slower of generation and training + sync)"),
             f"  bottleneck   {est.bottleneck}"]
    if est.bottleneck == "weight sync":
        lines.append("  balance      weight-sync bound: moving GPUs between roles does not help; "
                     "sync less often (train.sync_every) or over a faster transport")
    elif est.balanced_engine_replicas:
        same = (est.balanced_engine_replicas == e.replicas
                and est.balanced_trainer_workers == t.workers)
        lines.append(
            f"  balance      {'already balanced: ' if same else ''}{est.balanced_engine_replicas} "
            f"engine replicas ({est.balanced_engine_replicas * e.num_gpus:g} GPUs) + "
            f"{est.balanced_trainer_workers} trainer ranks "
            f"({est.balanced_trainer_workers * t.num_gpus:g} GPUs) of the same "
            f"{est.engine_gpus + est.trainer_gpus:g}: step {_s(est.balanced_step_s)}")
    else:
        lines.append("  balance      no GPUs in this recipe: add engine replicas (rollout) or "
                     "trainer workers (training), whichever is the bottleneck")
    for key in ("tokens_per_episode", "engine_tokens_per_s", "trainer_tokens_per_s", "sync",
                "params"):
        if key in src:
            lines.append(f"  source       {key}: {src[key]}")
    return lines
