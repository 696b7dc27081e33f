"""The vLLM backend inside the real stack: a Serve engine replica with backend "vllm" behind
the session server (chat turns, a published weight version reaching the replica), and one
short `rl360 eval` of the CPU demo recipe with `--set engine.backend=vllm`.

Serve replicas start the engine inside a Ray worker (vLLM spawns its engine core from
there), so no `__main__` guard is needed here; `rl360 eval` runs as its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rl360.ray_session import free_port
from tests.serving import open_session, serving
from tests.vllm.common import REPO, needs_vllm

pytestmark = [needs_vllm, pytest.mark.ray, pytest.mark.slow]

MODEL = "tiny:parity"  # head_dim 32: vLLM's CPU attention refuses the smaller presets


@pytest.fixture(scope="module")
def app(ray_cluster):  # type: ignore[no-untyped-def]
    with serving([f"model.path='{MODEL}'", "engine.backend='vllm'", "engine.replicas=1",
                  "serve.default_max_tokens=8"]) as h:
        yield h


def chat(app, sid: str, token: str, content: str) -> dict:  # type: ignore[no-untyped-def]
    r = httpx.post(f"{app.base_url}/sessions/{sid}/v1/chat/completions", timeout=600,
                   headers={"Authorization": f"Bearer {token}"},
                   json={"messages": [{"role": "user", "content": content}],
                         "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_sessions_on_a_vllm_replica_and_a_weight_update(app) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    from rl360.policies.loading import resolve_model_path

    sid, token = open_session(app.base_url)
    first = chat(app, sid, token, "hello")
    again = chat(app, sid, token, "hello")  # a retry of the same turn, greedy
    assert first["rl360"]["policy_version"] == 0
    assert first["choices"][0]["message"] == again["choices"][0]["message"]

    state = load_file(str(resolve_model_path(MODEL) / "model.safetensors"))
    state = {k: v * 1.5 + 0.02 for k, v in state.items()}
    assert app.publish_weights(1, state)
    deadline = time.monotonic() + 300
    while not app.weight_status()["applied"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert {v for v, _ in app.weight_status()["applied"].values()} == {1}

    sid2, token2 = open_session(app.base_url)
    out = chat(app, sid2, token2, "hello")
    assert out["rl360"]["policy_version"] == 1
    traj = httpx.get(f"{app.base_url}/sessions/{sid2}/trajectory",
                     headers={"Authorization": f"Bearer {token2}"}, timeout=30).json()
    gen = [(lp, v) for lp, v, m in zip(traj["logprobs"], traj["versions"], traj["mask"], strict=True) if m]
    assert gen and all(v == 1 and lp is not None and lp <= 0.0 for lp, v in gen)
    engines = app.weight_status()["engines"]
    assert engines and all(e.get("version") == 1 and e.get("ok") for e in engines.values())


def test_rl360_eval_with_the_vllm_engine(tmp_path: Path) -> None:
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "rl360", "eval", "recipes/cpu-demo.toml",
           "--set", "engine.backend=vllm", "--set", f"model.path={MODEL}",
           "--set", "eval.limit=2", "--set", "eval.attempts=2", "--set", "eval.concurrency=4",
           "--set", "env.actors=1", "--set", f"serve.port={free_port()}",
           "--set", f"run.out_dir={tmp_path}", "--set", "ray.dashboard=false"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    summary = json.loads((tmp_path / "cpu-demo" / "eval_summary.json").read_text())
    rows = summary["rows"]
    assert len(rows) == 2
    assert all(r["n"] == 2 and r["infra_errors"] == 0 for r in rows), rows
    lines = (tmp_path / "cpu-demo" / "eval.jsonl").read_text().splitlines()
    assert len(lines) == 4
    traj = json.loads(lines[0])
    assert any(traj["mask"]) and traj["reward"] is not None
