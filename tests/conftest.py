"""Shared fixtures. A local Ray cluster for the `ray` tier is started here and stopped by
its own fixture (127.0.0.1, auth off, usage stats off)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rl360.policies.loading import resolve_model_path

    return resolve_model_path("tiny")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def renderer(tiny_tokenizer):  # type: ignore[no-untyped-def]
    from rl360.policies.chat import ChatRenderer

    return ChatRenderer(tiny_tokenizer)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    ray.init(
        address="local",  # our own cluster, never one another process left running
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        namespace="rl360-tests",
        log_to_driver=False,
    )
    try:
        yield
    finally:
        try:
            from ray import serve

            serve.shutdown()
        finally:
            ray.shutdown()


# CI (.ci/run sets RL360_CI=1) runs every tier this kind of machine can run: a test it skips
# may only lack a GPU, a Docker engine, or be a named opt-in; any other skip fails the run
CI_SKIPS = ("no GPU", "no Docker engine", "opt-in")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("RL360_CI") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    bad = []
    for rep in getattr(reporter, "stats", {}).get("skipped", []):
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        if not reason.startswith(CI_SKIPS):
            bad.append(f"{rep.nodeid}: {reason}")
    if bad and reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", f"{len(bad)} skip(s) CI does not allow (only {', '.join(CI_SKIPS)})")
        for line in bad:
            reporter.write_line(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
