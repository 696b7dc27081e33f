"""`rl360 plan --estimate`: the step-time model, its figures (defaults, --throughput,
--metrics) and, on a real CPU demo run's metrics, a prediction within 30% of the measured
step time (tests/launch/data/cpu-demo-metrics.jsonl: see its README line for how it was made)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pytest

from rl360.launch.estimate import estimate
from rl360.launch.plan import plan_command
from rl360.launch.throughput import EstimateError, Figures, figures_for, override, refine
from rl360.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "cpu-demo.toml"
DENSE = REPO / "recipes" / "gpu-dense-8b.toml"
METRICS = Path(__file__).parent / "data" / "cpu-demo-metrics.jsonl"


def _rows() -> list[dict]:
    return [json.loads(x) for x in METRICS.read_text().splitlines() if x.strip()]


def _plan(args: argparse.Namespace) -> int:
    """`rl360 plan` as the CLI runs it: the recipe loaded from args, then the handler."""
    return plan_command(load_recipe(args.recipe, args.overrides), args)


def test_prediction_is_within_30_percent_of_the_demo_step_time(tmp_path: Path) -> None:
    """Figures refined from the first half of a real demo run predict the second half."""
    rows = _rows()
    assert len(rows) >= 6
    half = len(rows) // 2
    first = tmp_path / "first.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in rows[:half]))
    # the metrics come from a synchronous run of the demo recipe (which is asynchronous) at 32
    # groups a batch (tests/launch/data/README.md): the estimate is for the recipe they ran
    recipe = load_recipe(DEMO, ["train.max_staleness=0", "train.groups_per_batch=32"])
    est = estimate(recipe, figures_for(recipe, str(first)))
    measured = statistics.median(r["step_s"] for r in rows[half:])
    assert abs(est.step_s - measured) / measured <= 0.30, (est.step_s, measured)
    assert est.mode == "synchronous" and est.bottleneck == "rollout"
    # the whole run, refined from itself: training and sync as measured too
    full = estimate(recipe, figures_for(recipe, str(METRICS)))
    later = rows[1:]
    for got, key in ((full.training_s, "train_s"), (full.step_s, "step_s")):
        want = statistics.median(r[key] for r in later)
        assert abs(got - want) / want <= 0.30, (key, got, want)


def _figs(**kw: float) -> Figures:
    base = dict(engine_tokens_per_s=1000.0, trainer_tokens_per_s=500.0, sync_s=1.0,
                tokens_per_episode=100.0, params=1e9, active_params=1e9)
    base.update(kw)
    return Figures(**base)  # type: ignore[arg-type]


def test_step_model_sync_and_overlapped() -> None:
    r = load_recipe(DEMO, ["train.groups_per_batch=10", "train.group_size=10",
                           "train.max_staleness=0"])
    est = estimate(r, _figs())
    # 100 episodes x 100 tokens: 10 s generating on 1 replica, 20 s training on 1 rank, 1 s sync
    assert (est.generation_s, est.training_s, est.sync_s) == (10.0, 20.0, 1.0)
    assert est.step_s == 31.0 and est.bottleneck == "training"
    est = estimate(load_recipe(DEMO, ["train.groups_per_batch=10", "train.group_size=10",
                                      "train.max_staleness=1", "engine.replicas=2",
                                      "trainer.workers=4"]), _figs())
    assert (est.generation_s, est.training_s) == (5.0, 5.0)
    assert est.step_s == 6.0 and est.mode == "overlapped"
    est = estimate(load_recipe(DEMO, ["train.max_staleness=1", "train.sync_every=2"]),
                   _figs(sync_s=1000.0))
    assert est.sync_s == 500.0 and est.bottleneck == "weight sync"


def test_balance_moves_gpus_to_the_bottleneck() -> None:
    r = load_recipe(DENSE, ["train.sync_every=100"])
    # rollout-heavy: 96 engine replicas (192 GPUs) at 100 tok/s, training fast
    est = estimate(r, _figs(engine_tokens_per_s=100.0, trainer_tokens_per_s=1e5, sync_s=0.0,
                            params=0.0, seq_tokens_per_s=0.0))
    assert est.bottleneck == "rollout"
    assert est.balanced_engine_replicas > 96 and est.balanced_step_s < est.step_s
    total = est.balanced_engine_replicas * 2 + est.balanced_trainer_workers
    assert total <= 256
    # training-heavy: the split goes the other way
    est = estimate(r, _figs(engine_tokens_per_s=1e5, trainer_tokens_per_s=10.0, sync_s=0.0))
    assert est.bottleneck == "training" and est.balanced_trainer_workers > 64


def test_defaults_have_sources_and_gpu_rooflines() -> None:
    cpu = figures_for(load_recipe(DEMO))
    assert "CPU demo run" in cpu.sources["engine_tokens_per_s"] and cpu.params > 0
    gpu = figures_for(load_recipe(DENSE))
    assert gpu.params == 8e9 and "name" in gpu.sources["params"]
    assert "roofline" in gpu.sources["engine_tokens_per_s"] and gpu.seq_tokens_per_s > 0
    moe = figures_for(load_recipe(REPO / "recipes" / "gpu-moe-30b-a3b.toml"))
    assert (moe.params, moe.active_params) == (30e9, 3e9)


def test_overrides_and_bad_input(tmp_path: Path) -> None:
    f = _figs()
    override(f, ["engine_tokens_per_s=5", "params=2e9"])
    assert f.engine_tokens_per_s == 5 and f.active_params == 2e9
    assert f.sources["engine_tokens_per_s"] == "--throughput"
    for bad in ["speed=3", "engine_tokens_per_s", "sync_s=-1", "params=x"]:
        with pytest.raises(EstimateError, match="expected KEY=NUMBER"):
            override(_figs(), [bad])
    (tmp_path / "m.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(EstimateError, match="no rows with step_s"):
        refine(_figs(), load_recipe(DEMO), tmp_path / "m.jsonl")


def _args(*extra: str, metrics: str = "", throughput: list[str] | None = None,
          recipe: Path = DEMO) -> argparse.Namespace:
    return argparse.Namespace(recipe=str(recipe), overrides=list(extra), nodes="", address="",
                              json=False, estimate=True, metrics=metrics,
                              throughput=throughput or [])


def test_plan_prints_the_estimate(capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert _plan(_args(metrics=str(METRICS))) == 0
    out = capsys.readouterr().out
    assert "\nestimate  " in out and "bottleneck   rollout" in out
    assert f"{METRICS.name} (" in out
    assert _plan(_args(metrics="/nowhere.jsonl")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rl360 plan: --metrics '/nowhere.jsonl'")
    assert _plan(_args(recipe=DENSE)) == 0
    assert "balance" in capsys.readouterr().out
