"""A local cluster's processes get Serve's proxy-check timeouts of a loaded machine and a short
draining period for replicas behind the local HAProxy (a value the user set is kept), and an
existing cluster's are left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rl360.ray_session import LOCAL_SERVE_ENV

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

CODE = """
import json, os, ray
from rl360.ray_session import LOCAL_SERVE_ENV, ray_session
with ray_session(num_cpus=1, dashboard=False):
    @ray.remote(num_cpus=0)
    def env():
        return {k: os.environ.get(k) for k in LOCAL_SERVE_ENV}
    print(json.dumps(ray.get(env.remote())))
"""


def _worker_env(**extra: str) -> dict[str, str | None]:
    env = {k: v for k, v in os.environ.items() if k not in LOCAL_SERVE_ENV and k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", CODE], env={**env, **extra}, capture_output=True,
                         text=True, timeout=150, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_local_cluster_gives_serve_its_local_defaults_unless_set() -> None:
    assert _worker_env() == {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                             "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
                             "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
    got = _worker_env(RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S="7")
    assert got["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "7"
