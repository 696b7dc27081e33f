"""Shared by the GPU tier: skip conditions (with their reasons) and running gpu_check.py in its
own process (SGLang and vLLM start their engine processes with multiprocessing spawn, so
engine start-up sits under the script's `__main__` guard, never in a pytest module)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


HAS_CUDA = _cuda()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no GPU: the GPU tier runs on a GPU "
                                "machine (bash tests/gpu/run.sh)")
# on a GPU machine the tier installs sglang (tests/gpu/run.sh); elsewhere there is no GPU
needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                  reason="no GPU: sglang is installed on a GPU machine "
                                  "(pip install 'rl360[sglang]')")


def run_check(*args: str, timeout_s: float = 900) -> tuple[int, str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(HERE / "gpu_check.py"), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    return proc.returncode, proc.stdout + proc.stderr


def run_json(out: Path, *args: str, timeout_s: float = 900) -> dict[str, Any]:
    rc, text = run_check(*args, "--out", str(out), timeout_s=timeout_s)
    if not out.is_file():
        raise AssertionError(f"gpu_check {' '.join(args)} wrote nothing (rc={rc}):\n{text[-6000:]}")
    return json.loads(out.read_text())
