"""Where an agent program runs: inside the task's sandbox (RL360's agent worker) or beside it.

Inside, the agent's model calls cross the in-sandbox relay and the session bridge (a Unix socket
into the env actor) to the session server; its shell commands are its own subprocesses. Beside,
its model calls would go straight to the server and each command through the sandbox's exec
channel. Both measured here on the same host, from one run:

  model call: N POSTs of a 2 KB chat body on one keep-alive connection to a server that answers
      at once (so only the path is timed), from a client inside a bwrap sandbox through relay
      and bridge vs the same client on the host straight to the server;
  command:    N runs of `bash -c true`, as the agent's own subprocess inside the sandbox vs
      `Sandbox.exec` from the host (what a beside agent would pay per command);
  --agent-start: `import litellm` (mini-swe-agent's model layer) inside the sandbox vs on the
      host, in CPU seconds and peak memory: the agent's own start-up, either way.

Prints the workload, each median (of 3 repeats, each the median of N), the ratios, and as its
last line {"bench": "agent_bridge", ...}.

Run: .venv/bin/python bench/agent_bridge.py [--n 200] [--agent-start]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

from aiohttp import web

from rl360.envs.agent_programs import module_root
from rl360.envs.agent_worker import RELAY_SOURCE
from rl360.envs.sandbox import SandboxLimits, build_sandbox
from rl360.envs.session_bridge import SessionBridge, SessionEndpoint

PORT_IN_SANDBOX = 41641
# the client: N POSTs on one keep-alive connection, prints the median latency in ms
CLIENT = r"""
import http.client, json, statistics, sys, time, urllib.parse
url, n = urllib.parse.urlsplit(sys.argv[1]), int(sys.argv[2])
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]})
conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
hdr = {"Authorization": "Bearer tok", "Content-Type": "application/json"}
ts = []
for _ in range(n):
    t = time.perf_counter()
    conn.request("POST", url.path + "/chat/completions", body, hdr)
    r = conn.getresponse(); r.read()
    assert r.status == 200, r.status
    ts.append(time.perf_counter() - t)
print(statistics.median(ts) * 1000)
"""
# N subprocess runs of `bash -c true`, median ms
COMMANDS = r"""
import statistics, subprocess, sys, time
ts = []
for _ in range(int(sys.argv[1])):
    t = time.perf_counter()
    subprocess.run(["bash", "-c", "true"], check=True)
    ts.append(time.perf_counter() - t)
print(statistics.median(ts) * 1000)
"""
# mini-swe-agent's model layer: its CPU seconds and peak resident MB
START = ("import resource, litellm; u = resource.getrusage(resource.RUSAGE_SELF); "
         "print(u.ru_utime + u.ru_stime, u.ru_maxrss / 1024)")
REPLY = {"id": "r", "object": "chat.completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                      "finish_reason": "stop"}]}


async def answer(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response(REPLY)


async def main(n: int, repeats: int, agent_start: bool) -> dict[str, float]:
    app = web.Application()
    app.router.add_post("/sessions/s1/v1/chat/completions", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    endpoint = SessionEndpoint(f"http://127.0.0.1:{port}", "s1", "tok")
    bridge = SessionBridge(endpoint)
    await bridge.start()
    roots = sorted({module_root("litellm")}) if agent_start else []
    # nice 0: the path is measured, not the scheduler (sandboxes default to nice 10)
    sandbox = build_sandbox("bwrap", SandboxLimits(memory_mb=2048, cpu_seconds=600,
                                                   timeout=600.0, nice=0),
                            ro_binds=[bridge.directory, *roots])
    await sandbox.start()
    python = sandbox.python.executable  # type: ignore[attr-defined]
    out: dict[str, list[float]] = {k: [] for k in ("call_bridge", "call_direct", "cmd_inside",
                                                    "cmd_beside")}
    try:
        for _ in range(repeats):
            relay = [python, "-I", "-S", "-c", RELAY_SOURCE, str(PORT_IN_SANDBOX),
                     bridge.socket_path, "--"]
            r = await sandbox.exec([*relay, python, "-c", CLIENT,
                                    f"http://127.0.0.1:{PORT_IN_SANDBOX}/v1", str(n)],
                                   timeout=300)
            assert r.exit_code == 0, r.stderr
            out["call_bridge"].append(float(r.stdout))
            # not subprocess.run: the server answers on this process's event loop
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", CLIENT, endpoint.url, str(n),
                stdout=asyncio.subprocess.PIPE)
            direct, _ = await proc.communicate()
            assert proc.returncode == 0
            out["call_direct"].append(float(direct))
            r = await sandbox.exec([python, "-c", COMMANDS, str(n)], timeout=300)
            assert r.exit_code == 0, r.stderr
            out["cmd_inside"].append(float(r.stdout))
            ts = []
            for _ in range(n):
                t = time.perf_counter()
                await sandbox.exec(["bash", "-c", "true"], timeout=30)
                ts.append(time.perf_counter() - t)
            out["cmd_beside"].append(statistics.median(ts) * 1000)
        if agent_start:  # CPU seconds and peak memory: a loaded host stretches only the wall
            env = {"PYTHONPATH": ":".join(roots), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
            out["start_inside_cpu_s"], out["start_beside_cpu_s"] = [], []
            out["start_inside_mb"], out["start_beside_mb"] = [], []
            for _ in range(repeats):
                r = await sandbox.exec([python, "-c", START], timeout=600, env=env)
                assert r.exit_code == 0, r.stderr
                cpu, mb = map(float, r.stdout.split())
                out["start_inside_cpu_s"].append(cpu)
                out["start_inside_mb"].append(mb)
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", START, env={**os.environ, **env},
                    cwd=tempfile.gettempdir(), stdout=asyncio.subprocess.PIPE)
                got, _ = await proc.communicate()
                cpu, mb = map(float, got.split())
                out["start_beside_cpu_s"].append(cpu)
                out["start_beside_mb"].append(mb)
    finally:
        await sandbox.close()
        await bridge.close()
        await runner.cleanup()
    return {k: statistics.median(v) for k, v in out.items()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--agent-start", action="store_true")
    a = ap.parse_args()
    print(f"workload: {a.n} model calls (2 KB body, instant answer) and {a.n} `bash -c true` "
          f"per repeat, median of {a.repeats} repeats; bwrap sandbox, {os.cpu_count()} CPUs")
    m = asyncio.run(main(a.n, a.repeats, a.agent_start))
    print(f"model call: through relay + bridge {m['call_bridge']:.2f} ms, direct "
          f"{m['call_direct']:.2f} ms (+{m['call_bridge'] - m['call_direct']:.2f} ms, "
          f"x{m['call_bridge'] / m['call_direct']:.2f})")
    print(f"command:    inside (own subprocess) {m['cmd_inside']:.2f} ms, beside "
          f"(Sandbox.exec) {m['cmd_beside']:.2f} ms (x{m['cmd_beside'] / m['cmd_inside']:.2f})")
    if "start_inside_cpu_s" in m:
        print(f"agent start (import litellm): inside {m['start_inside_cpu_s']:.1f} CPU s, "
              f"{m['start_inside_mb']:.0f} MB; beside {m['start_beside_cpu_s']:.1f} CPU s, "
              f"{m['start_beside_mb']:.0f} MB")
    print(json.dumps({"bench": "agent_bridge", **{k: round(v, 3) for k, v in m.items()},
                      "call_overhead_ms": round(m["call_bridge"] - m["call_direct"], 3),
                      "cmd_ratio_beside_inside": round(m["cmd_beside"] / m["cmd_inside"], 3)}))
