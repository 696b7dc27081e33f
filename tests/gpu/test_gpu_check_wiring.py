"""Runs on any machine: every part of the GPU check script imports and wires its arguments
(--dry-run), the model builder makes a loadable Qwen2-shaped model, and run.sh parses."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.gpu.common import HERE, run_check


@pytest.mark.parametrize("args", [
    ["build-model", "/tmp/unused"],
    ["parity", "--engine", "sglang", "--model", "/tmp/m", "--out", "/tmp/o.json"],
    ["parity", "--engine", "vllm", "--model", "/tmp/m", "--out", "/tmp/o.json"],
    ["nccl", "--out", "/tmp/o.json"],
    ["bench", "--engine", "sglang", "--model", "/tmp/m"],
    ["bench", "--engine", "vllm", "--model", "/tmp/m"],
])
def test_each_part_dry_runs(args: list[str]) -> None:
    rc, text = run_check(*args, "--dry-run", timeout_s=120)
    assert rc == 0, text[-3000:]
    info = json.loads(text.strip().splitlines()[-1])
    assert info["dry_run"] == args[0] and "sglang" in info["backends"]
    if args[0] == "bench":
        assert info["wired"]["recipe_engine"][:2] == [args[2], 1.0]


def test_model_builder_makes_a_loadable_qwen2(tmp_path: Path) -> None:
    from transformers import AutoConfig

    rc, text = run_check("build-model", str(tmp_path / "m"), "--layers", "1", timeout_s=300)
    assert rc == 0, text[-3000:]
    cfg = AutoConfig.from_pretrained(tmp_path / "m")
    assert (cfg.model_type, cfg.hidden_size, cfg.num_attention_heads) == ("qwen2", 896, 14)
    assert (tmp_path / "m" / "tokenizer.json").is_file()


def test_run_sh_parses() -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash here")
    proc = subprocess.run([bash, "-n", str(HERE / "run.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
