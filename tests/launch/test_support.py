"""Recipes are checked against what their backends declare they support: every shipped recipe
passes `rl360 plan` and `rl360 preflight`'s support check; a recipe asking for a layout, family,
dtype or device its backend cannot run fails in one line naming the key and what is supported."""

from __future__ import annotations

import argparse
import json
import typing
from pathlib import Path

import pytest

from rl360.launch.plan import plan_command
from rl360.launch.preflight import check_support
from rl360.launch.support import model_family, support_problems
from rl360.policies.support import TRAINER_SUPPORT
from rl360.recipe import (
    EngineSection,
    Recipe,
    TrainerSection,
    apply_overrides,
    decode_recipe,
    load_recipe,
)
from rl360.serve.engines.base import BACKENDS
from rl360.serve.engines.support import ENGINE_SUPPORT

REPO = Path(__file__).resolve().parents[2]
ELSEWHERE = "model.path='/models/not-on-this-machine'"
RECIPES = sorted((REPO / "recipes").glob("*.toml"))


def _recipe(*overrides: str) -> Recipe:
    return decode_recipe(apply_overrides({}, list(overrides)))


def _plan_args(recipe: Path, *overrides: str) -> argparse.Namespace:
    return argparse.Namespace(recipe=str(recipe), overrides=list(overrides), nodes="",
                              address="", json=False, estimate=False, metrics="",
                              throughput=[])


def _plan(args: argparse.Namespace) -> int:
    """`rl360 plan` as the CLI runs it: the recipe loaded from args, then the handler."""
    return plan_command(load_recipe(args.recipe, args.overrides), args)


def test_every_backend_name_declares_its_support() -> None:
    def names(section: type, field: str) -> set[str]:
        hints = typing.get_type_hints(section, include_extras=True)
        return set(typing.get_args(hints[field]))

    assert names(EngineSection, "backend") == set(ENGINE_SUPPORT) == set(BACKENDS)
    assert names(TrainerSection, "backend") == set(TRAINER_SUPPORT)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_shipped_recipe_passes_plan_and_preflight_support(
        path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    recipe = load_recipe(path)
    assert support_problems(recipe) == []
    assert all(c.status != "fail" for c in check_support(recipe))
    assert _plan(_plan_args(path)) == 0, capsys.readouterr().err
    if recipe.model.path.startswith("/models/"):  # a cluster recipe: its family is declared
        assert recipe.model.family != "auto"


def test_megatron_refuses_pipeline_and_expert_parallel_layouts(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Layouts the Megatron trainer cannot run: the GPU recipes with PP 2, and with EP 8 on a
    MoE. `rl360 plan` refuses them in one line each, naming key and support."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    dense = REPO / "recipes" / "gpu-dense-8b.toml"
    rc = _plan(_plan_args(dense, "trainer.backend='megatron'", "trainer.megatron.tensor_parallel=2",
                              "trainer.megatron.pipeline_parallel=2"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("rl360 plan: trainer.megatron.pipeline_parallel=2: the "
                                               "'megatron' trainer backend supports")
    assert "tensor_parallel<=64" in err[0]
    moe = REPO / "recipes" / "gpu-moe-30b-a3b.toml"
    rc = _plan(_plan_args(moe, "trainer.backend='megatron'", "trainer.megatron.expert_parallel=8"))
    err = capsys.readouterr().err
    assert rc == 2
    assert "trainer.megatron.expert_parallel=8: the 'megatron' trainer backend" in err
    assert "model.family='qwen3_moe' is a mixture of experts" in err


@pytest.mark.parametrize(("overrides", "expect"), [
    (["engine.backend='sglang'"], "engine.num_gpus: the 'sglang' engine backend runs on cuda"),
    (["engine.tensor_parallel=2", "engine.num_gpus=2"],
     "engine.tensor_parallel=2: the 'torch' engine backend supports data parallel only"),
    (["engine.backend='vllm'", "engine.num_gpus=2", "engine.tensor_parallel=2",
      "engine.expert_parallel=2", "model.family='qwen3_moe'", ELSEWHERE],
     "engine.expert_parallel=2: the 'vllm' engine backend supports tensor_parallel<=64"),
    (["trainer.backend='megatron'", "model.family='gpt2'", ELSEWHERE],
     "model.family='gpt2': the 'megatron' trainer backend supports model families llama, "
     "qwen2, qwen3"),
    (["trainer.backend='fsdp'", "trainer.megatron.context_parallel=2"],
     "trainer.megatron.context_parallel=2: the 'fsdp' trainer backend supports data parallel only"),
    (["engine.backend='sglang'", "engine.num_gpus=1", "engine.expert_parallel=2",
      "model.family='qwen3'", ELSEWHERE], "engine.expert_parallel=2: model family 'qwen3' has no experts"),
    (["model.family='qwen3'"], "model.family='qwen3' but model.path 'tiny' is 'llama'"),
])
def test_unsupported_asks_fail_in_one_line_naming_the_key(overrides: list[str], expect: str) -> None:
    problems = support_problems(_recipe(*overrides))
    assert any(p.startswith(expect) for p in problems), problems
    assert all("\n" not in p for p in problems)
    checks = check_support(_recipe(*overrides))
    assert any(c.status == "fail" and c.detail.startswith(expect) for c in checks)


def test_sglang_server_elsewhere_skips_the_device_check() -> None:
    r = _recipe("engine.backend='sglang'", "engine.options={url='http://h:30000', mode='http'}")
    assert support_problems(r) == []


def test_family_comes_from_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    r = _recipe(f"model.path='{tmp_path}'", "trainer.backend='megatron'")
    assert model_family(r) == ("qwen3_moe", str(tmp_path / "config.json"))
    assert any("is a mixture of experts" in p for p in support_problems(r))
    unknown = _recipe("model.path='/nowhere/model'")
    assert model_family(unknown)[0] is None and support_problems(unknown) == []
    assert [c.status for c in check_support(unknown)] == ["warn"]
