"""Recipes decode with clear errors; the CLI starts without heavy imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rl360.recipe import RecipeError, apply_overrides, decode_recipe, load_recipe

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.toml")), ids=lambda p: p.name)
def test_every_recipe_decodes(path: Path) -> None:
    load_recipe(path)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("engine.replicas=0", "engine.replicas: expected an int >= 1, got 0"),
        ("engine.replica=2", "engine.replica: unknown key"),
        ("eval.sampling.top_p=1.5", "eval.sampling.top_p: expected a float in (0, 1], got 1.5"),
        ("model.dtype='int4'",
         "model.dtype: expected one of 'bfloat16', 'float16', 'float32', got 'int4'"),
        ("serve.port=70000", "serve.port: expected an int in [1, 65535], got 70000"),
        ("trainer.loss.tis_cap=0.5", "trainer.loss.tis_cap: expected 0 (off) or >= 1, got 0.5"),
        ("engine.weight_update='sometimes'",
         "engine.weight_update: expected one of 'auto', 'drain', 'inflight', got 'sometimes'"),
        ("engine.weight_update='inflight'",  # the default backend is torch: fine
         None),
        ("train.weight_sync.transport='mpi'",
         "train.weight_sync.transport: unknown weight_sync 'mpi' (choose from object_store, "
         "collective)"),
    ],
)
def test_bad_values_name_the_key_and_range(override: str, expected: str | None) -> None:
    if expected is None:
        decode_recipe(apply_overrides({}, [override]))
        return
    with pytest.raises(RecipeError) as err:
        decode_recipe(apply_overrides({}, [override]))
    assert expected in str(err.value)


def test_inflight_weight_updates_need_the_torch_engine() -> None:
    with pytest.raises(RecipeError, match="engine: weight_update = 'inflight' needs backend = 'torch'"):
        decode_recipe({"engine": {"backend": "vllm", "weight_update": "inflight"}})
    assert decode_recipe({"engine": {"backend": "sglang"}}).engine.weight_update == "auto"


def test_set_overrides_any_field(tmp_path: Path) -> None:
    p = tmp_path / "r.toml"
    p.write_text("[engine]\nreplicas = 1\n")
    r = load_recipe(p, ["engine.replicas=3", "eval.sampling.temperature=0.5", "run.name=x y"])
    assert r.engine.replicas == 3 and r.eval.sampling.temperature == 0.5 and r.run.name == "x y"
    with pytest.raises(RecipeError, match="expected KEY=VALUE"):
        load_recipe(p, ["engine.replicas"])


def test_missing_or_broken_recipe_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine\n")
    with pytest.raises(RecipeError, match="not valid TOML"):
        load_recipe(bad)


def test_help_imports_neither_torch_nor_ray() -> None:
    code = (
        "import sys, contextlib, io\n"
        "from rl360.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: main(['--help'])\n"
        "    except SystemExit: pass\n"
        "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_reports_recipe_errors_in_one_line(tmp_path: Path) -> None:
    p = tmp_path / "r.toml"
    p.write_text("[engine]\nreplicas = -1\n")
    out = subprocess.run([sys.executable, "-m", "rl360", "recipe", "check", str(p)],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "rl360: recipe error: engine.replicas: expected an int >= 1, got -1"
    ]


def test_every_command_handler_resolves() -> None:
    """Each command's handler names a module and function that exist (`rl360 sft` pointed at a
    module that had been renamed, and failed only when run)."""
    from rl360.cli import COMMANDS, _handler

    for name, cmd in COMMANDS.items():
        assert callable(_handler(cmd.handler)), name
