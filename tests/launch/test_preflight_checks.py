"""Preflight: each check passes on a good setup and fails in one line that names the fix."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rl360.launch import preflight
from rl360.launch.preflight import (
    check_backends,
    check_disk,
    check_model,
    check_ports,
    check_ray,
    check_sandbox,
    format_checks,
    run_preflight,
)
from rl360.recipe import Recipe, apply_overrides, decode_recipe
from tests.ports import free_ports

REPO = Path(__file__).resolve().parents[2]


def _recipe(*overrides: str) -> Recipe:
    return decode_recipe(apply_overrides({}, list(overrides)))


def _one_line(check: preflight.Check) -> None:
    assert "\n" not in check.detail


def test_cpu_demo_passes_here(tmp_path: Path) -> None:
    recipe = _recipe(f"run.out_dir='{tmp_path}'", f"serve.port={free_ports()[0]}",
                     "ray.dashboard=false")
    checks = run_preflight(recipe, live=False)
    names = [c.name for c in checks]
    assert names[:4] == ["python", "ray", "engine", "trainer"]
    assert {"gpus", "sandbox", "model", "disk", "port"} <= set(names)
    bad = [c for c in checks if c.status == "fail"]
    assert not bad, format_checks(bad)


def test_ray_version_pin() -> None:
    assert check_ray().status == "ok"
    c = check_ray(pinned="0.0.1")
    assert c.status == "fail" and "pip install 'ray[default,serve]==0.0.1'" in c.detail
    _one_line(c)


def test_gpu_backends_need_their_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "_find", lambda module: False)
    engine, trainer = check_backends(_recipe("engine.backend='sglang'", "trainer.backend='megatron'"))
    assert engine.status == "fail" and "pip install 'rl360[sglang]'" in engine.detail
    assert trainer.status == "fail" and "pip install 'rl360[megatron]'" in trainer.detail


def test_model_path(tmp_path: Path) -> None:
    assert check_model(_recipe("model.path='tiny'")).status == "ok"
    c = check_model(_recipe("model.path='/models/Qwen3-8B'"))
    assert c.status == "fail"
    assert c.detail == ("model.path '/models/Qwen3-8B' has no config.json: put the HF model there "
                        "(on every node) or --set model.path=<HF directory>")
    (tmp_path / "config.json").write_text("{}")
    assert check_model(_recipe(f"model.path='{tmp_path}'")).status == "ok"


def test_free_disk(tmp_path: Path) -> None:
    out = tmp_path / "not" / "yet"
    ok = check_disk(_recipe(f"run.out_dir='{out}'", "run.min_free_disk_gb=0.001"))
    assert ok.status == "ok" and str(tmp_path) in ok.detail  # the nearest existing parent
    bad = check_disk(_recipe(f"run.out_dir='{out}'"), min_free_gb=10**9)
    assert bad.status == "fail" and "--set run.out_dir=<a larger disk>" in bad.detail
    _one_line(bad)


def test_ports_in_use() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        serve, *_ = check_ports(_recipe(f"serve.port={port}", "ray.dashboard=false"))
    assert serve.status == "fail"
    assert serve.detail == (f"serve.port {port} is in use on 127.0.0.1: stop what holds it or "
                            "--set serve.port=<a free port>")


def test_sandbox_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from rl360.envs.sandbox import bwrap

    real = bwrap.bwrap_unavailable
    monkeypatch.setattr(bwrap, "bwrap_unavailable", lambda: "bubblewrap (bwrap) is not installed")
    c = check_sandbox()
    assert c.status == "fail" and "env.allow_unsandboxed" in c.detail  # no silent downgrade
    c = check_sandbox(_recipe("env.allow_unsandboxed=true"))
    assert c.status == "warn" and "UNSANDBOXED" in c.detail
    monkeypatch.setattr(bwrap, "bwrap_unavailable", real)
    if real() is None:  # a real bwrap sandbox: every protection it lacks is named
        c = check_sandbox()
        assert c.status in ("ok", "warn"), c
        assert c.status == "ok" or "MISSING protections" in c.detail


def test_gpu_recipe_without_a_cluster_is_skipped_not_failed() -> None:
    recipe = _recipe("cluster.service.nodes=1", "cluster.train.nodes=1",
                     "cluster.rollout.nodes=1")
    gpus = next(c for c in run_preflight(recipe, live=False) if c.name == "gpus")
    assert gpus.status == "skip" and "--address" in gpus.detail


def test_local_plan_that_does_not_fit_fails() -> None:
    recipe = _recipe("ray.num_cpus=2", "engine.replicas=4")
    gpus = next(c for c in run_preflight(recipe, live=False) if c.name == "gpus")
    assert gpus.status == "fail" and gpus.detail.startswith("rollout: needs 4 CPUs")


def test_cli_exit_codes(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[run]\nout_dir = "{tmp_path}"\n[model]\npath = "/nope/model"\n')
    out = subprocess.run([sys.executable, "-m", "rl360", "preflight", str(bad)], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert "FAIL  model    model.path '/nope/model' has no config.json" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("preflight: ")
