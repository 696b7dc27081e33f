"""The merge recipe schema and the `rl360 merge` command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from merge_helpers import TAUS, write_checkpoint

from rl360.merge import MergeError, cli
from rl360.merge import recipe as R

REPO = Path(__file__).resolve().parents[2]
BASE = {"base": "b", "experts": [{"path": "e"}], "output": {"dir": "o"}}


def error(raw: dict) -> str:
    with pytest.raises(MergeError) as info:
        R.parse_recipe(raw)
    return str(info.value)


def test_example_recipe_parses():
    recipe = R.load_recipe(REPO / "examples" / "merge" / "merge.toml")
    assert isinstance(recipe.method, R.Ram) and recipe.method.epsilon == 1e-5
    assert [e.label for e in recipe.experts] == ["code", "tools"]
    assert recipe.output.dtype == "auto" and recipe.run.ray is False


def test_every_method_parses_with_defaults():
    for name in R.METHOD_NAMES:
        extra = {"evaluator": "x.toml"} if name == "greedy_soup" else {}
        cfg = R.parse_recipe({**BASE, "method": {"name": name, **extra}}).method
        assert type(cfg).__struct_config__.tag == name


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ({"name": "ties", "density": 1.5}, "method.density: expected a float in (0, 1], got 1.5"),
        ({"name": "dare_ties", "density": 0}, "method.density: expected a float in (0, 1], got 0"),
        ({"name": "ties", "densty": 0.3}, "method.densty: unknown key"),
        ({"name": "tie"}, "method.name: unknown method 'tie' (choose from soup,"),
        ({"density": 0.3}, "method.name: missing required key"),
        (
            {"name": "ties", "scope": "layer"},
            "method.scope: expected one of 'model', 'tensor', got 'layer'",
        ),
        ({"name": "ulp_gate", "gate": 0}, "method.gate: expected an int >= 1, got 0"),
        (
            {"name": "ram_plus", "rescale_factor": 0.9},
            "method.rescale_factor: expected a float >= 1, got 0.9",
        ),
        ({"name": "iso_cts", "alpha": "big"}, "method.alpha: expected a float, got str"),
        ({"name": "greedy_soup"}, "method.evaluator: missing required key"),
    ],
)
def test_bad_method_values_name_the_dotted_key(method, message):
    assert error({**BASE, "method": method}).startswith(message)


def test_bad_top_level_values_name_the_dotted_key():
    ram = {"name": "ram"}
    assert error({**BASE, "method": ram, "extra": 1}) == "extra: unknown key"
    assert error({**BASE, "method": ram, "experts": []}).startswith(
        "experts: expected a list of at least 1"
    )
    bad_expert = {**BASE, "method": ram, "experts": [{"path": "a"}, {"path": "b", "wieght": 2}]}
    assert error(bad_expert) == "experts[1].wieght: unknown key"
    nan = {**BASE, "method": ram, "experts": [{"path": "a", "weight": float("nan")}]}
    assert error(nan) == "experts[0].weight: expected a finite float"
    size = {**BASE, "method": ram, "output": {"dir": "o", "max_shard_size": "big"}}
    assert error(size).startswith("output.max_shard_size: expected a size like")
    assert (
        error({**BASE, "method": ram, "run": {"chunk_elements": 5}})
        == "run.chunk_elements: expected an int >= 1024, got 5"
    )
    assert (
        error({"experts": [{"path": "a"}], "method": ram, "output": {"dir": "o"}})
        == "base: missing required key"
    )


def test_parse_size():
    assert R.parse_size("2GB") == 2 * 10**9 and R.parse_size("1.5MiB") == 3 * 2**19
    assert R.parse_size("4096") == 4096


def write_recipe(tmp_path: Path, method: str) -> Path:
    base = torch.tensor([0.5, -0.25, 1.0, 0.125, 0.25, -0.75])
    write_checkpoint(tmp_path / "base", {"w": base})
    for i, t in enumerate(TAUS):
        write_checkpoint(tmp_path / f"e{i}", {"w": base + torch.tensor(t)})
    experts = "\n".join(f'[[experts]]\npath = "{tmp_path}/e{i}"\n' for i in range(3))
    text = f'base = "{tmp_path}/base"\n{experts}\n[method]\n{method}\n\n[output]\ndir = "{tmp_path}/out"\n'
    (tmp_path / "merge.toml").write_text(text)
    return tmp_path / "merge.toml"


def test_cli_merges_and_prints_a_summary(tmp_path, capsys):
    recipe = write_recipe(tmp_path, 'name = "ram"')
    assert cli.main([str(recipe), "--no-progress", "--set", "method.name=ram_plus"]) == 0
    out = capsys.readouterr().out
    assert "merged 3 experts with ram_plus" in out and "expert shares" in out and "changed" in out
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert (
        cli.main([str(recipe), "--no-progress", "--overwrite", "--dtype", "bfloat16", "--json"])
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["method"] == "ram" and summary["out_dtypes"] == ["BF16"]
    assert summary["stats"]["absorbed"] >= 0 and len(summary["shares"]) == 3


@pytest.mark.parametrize(
    ("method", "args", "message"),
    [
        ('name = "ties"\ndensity = 2.0', [], "method.density: expected a float in (0, 1], got 2.0"),
        (
            'name = "ram"',
            ["--set", "method.epsilon=-1"],
            "method.epsilon: expected a float >= 0, got -1",
        ),
        (
            'name = "ram"',
            ["--out", "{tmp}/merge.toml"],
            "is not a directory",
        ),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, method, args, message):
    recipe = write_recipe(tmp_path, method)
    args = [a.format(tmp=tmp_path) for a in args]
    assert cli.main([str(recipe), "--no-progress", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rl360 merge: error: ") and "\n" not in err
    assert message in err


def test_cli_shape_mismatch_exit_2(tmp_path, capsys):
    recipe = write_recipe(tmp_path, 'name = "soup"')
    write_checkpoint(tmp_path / "e1", {"w": torch.zeros(7)})
    assert cli.main([str(recipe), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "tensor w: shape [7] in expert 'e1' but [6] in the base" in err


def test_the_project_cli_lists_merge():
    from rl360 import cli as project_cli

    args = project_cli.build_parser().parse_args(["merge", "r.toml", "--ray", "--set", "a=1"])
    assert args.command == "merge" and args.ray is True and args.overrides == ["a=1"]
    assert project_cli.COMMANDS["merge"].handler == "rl360.merge.cli:run_args"
