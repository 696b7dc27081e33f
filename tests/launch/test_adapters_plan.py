"""trainer.lora before a run: `rl360 recipe check` and `rl360 plan` refuse targets the model
does not have; the plan's adapter size is the trainer's own count of adapter parameters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rl360.launch.adapters import (
    adapter_params,
    check_lora_targets,
    memory_lines,
    projection_shapes,
)
from rl360.recipe import LoraSection, RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[2]


def test_config_shapes_and_adapter_size_match_the_model(tiny_dir: Path) -> None:
    import torch

    from rl360.policies.lora import LoraSpec, add_lora, layer_linears
    from rl360.policies.native_llama import load_native_llama, native_config

    cfg = native_config(tiny_dir)
    assert cfg is not None
    model = load_native_llama(tiny_dir, cfg, torch.float32, torch.device("cpu"))
    live = {n: (m.out_features, m.in_features) for n, m in layer_linears(model).items()}
    assert projection_shapes(tiny_dir) == live
    lora = LoraSection(rank=3, targets=["q_proj", "down_proj", "v_proj"])
    add_lora(model, LoraSpec.of(lora))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert adapter_params(lora, live) == trainable


def test_plan_prints_adapter_memory_and_version_bytes() -> None:
    recipe = load_recipe(REPO / "recipes" / "cpu-demo.toml", ["model.path='tiny'",
                                                               "trainer.lora.rank=4"])
    lines = memory_lines(recipe)
    assert lines[0].startswith("adapters  rank 4, alpha 32 on q_proj")
    assert "trainer rank" in lines[1] and "full fine-tuning" in lines[1]
    assert "x fewer bytes" in lines[2]
    assert memory_lines(load_recipe(REPO / "recipes" / "cpu-demo.toml")) == []


def test_targets_the_model_lacks_are_refused_by_check_and_plan(tmp_path: Path) -> None:
    bad = ["model.path='tiny'", "trainer.lora.targets=['q_proj', 'c_attn']"]
    with pytest.raises(RecipeError, match=r"'c_attn' is not a linear projection .*q_proj"):
        check_lora_targets(load_recipe(REPO / "recipes" / "cpu-demo.toml", bad))
    check_lora_targets(load_recipe(REPO / "recipes" / "cpu-demo.toml", ["model.path='tiny'"]))
    # a model that is not here is not checked (the trainer checks it at start-up)
    check_lora_targets(load_recipe(REPO / "recipes" / "gpu-dense-8b.toml",
                                   ["trainer.lora.targets=['c_attn']"]))
    text = (REPO / "recipes" / "cpu-demo.toml").read_text().replace(
        'path = "tiny:demo"', 'path = "tiny"') + '\n[trainer.lora]\ntargets = ["c_attn"]\n'
    (tmp_path / "r.toml").write_text(text.replace("[trainer.loss]", "[trainer.loss]", 1))
    out = subprocess.run([sys.executable, "-m", "rl360", "recipe", "check", str(tmp_path / "r.toml")],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and "'c_attn' is not a linear projection" in out.stderr
    plan = subprocess.run([sys.executable, "-m", "rl360", "plan", str(tmp_path / "r.toml")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert plan.returncode == 2 and "trainer.lora.targets: 'c_attn'" in plan.stderr


@pytest.mark.parametrize(("sets", "error"), [
    (["trainer.backend='megatron'"], "megatron backend trains every weight"),
    (["train.weight_sync={transport='object_store', delta=true}"], "sent whole"),
    (["train.weight_sync={transport='collective', backend='nccl'}"], "backend 'gloo'"),
    (["engine.core_process=true"], "engine.core_process = true takes whole weight versions"),
    (["trainer.lora.rank=0"], r"trainer.lora.rank: expected an int in \[1, 1024\]"),
    (["trainer.lora.targets=['q_proj', 'q_proj']"], "listed twice"),
])
def test_recipes_refuse_what_adapters_cannot_do(sets: list[str], error: str) -> None:
    with pytest.raises(RecipeError, match=error):
        load_recipe(REPO / "recipes" / "cpu-demo.toml", ["trainer.lora.rank=8", *sets])


def test_adapters_can_be_switched_off_from_the_command_line() -> None:
    on = load_recipe(REPO / "recipes" / "smollm2-tools.toml")
    assert on.trainer.lora is not None and on.trainer.lora.rank == 16
    off = load_recipe(REPO / "recipes" / "smollm2-tools.toml", ["trainer.lora.enabled=false"])
    assert off.trainer.lora is None


def test_vllm_and_sglang_engines_start_with_lora_for_the_adapters() -> None:
    from rl360.launch.adapters import engine_for

    for backend, want in (("vllm", {"enable_lora": True, "max_lora_rank": 16, "max_loras": 1}),
                          ("sglang", {"enable_lora": True, "max_lora_rank": 16})):
        r = load_recipe(REPO / "recipes" / "cpu-demo.toml",
                        [f"engine.backend='{backend}'", "trainer.lora.rank=16",
                         "engine.weight_update='drain'", "engine.options={max_loras=4}"])
        opts = engine_for(r).options
        assert {k: opts[k] for k in want if k != "max_loras"} == {
            k: v for k, v in want.items() if k != "max_loras"}
        assert opts["max_loras"] == 4  # the recipe's own option wins
    plain = load_recipe(REPO / "recipes" / "cpu-demo.toml", ["trainer.lora.rank=16"])
    assert engine_for(plain) == plain.engine  # the torch engine needs nothing at start
