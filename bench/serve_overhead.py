"""Serve overhead: the same generation work (a) direct to the torch backend in process and
(b) through the session server over HTTP with N concurrent sessions.

    .venv/bin/python bench/serve_overhead.py [--mode retry|agent] [--sessions 16]
                                             [--requests 8] [--max-tokens 96] [--turns 8]
                                             [--threads 1] [--ingress proxy|haproxy]
                                             [--core-process]

`retry`: each session sends the same first turn `--requests` times (siblings in its ledger).
`agent` (the real agent case): each session is one episode of `--turns` turns; every turn
appends the assistant's reply and a tool result to the conversation and sends all of it, as
an OpenAI client does; the ledger appends the new turn's template delta. The in-process side
builds the same prompt ids the cheapest way there is (previous prompt + generated ids +
the tool turn's token delta, rendered once) and calls the backend directly: the engine work is
the same tokens with the same seeds on both sides, what differs is the server's HTTP, hops,
ledger and templating. The client is aiohttp + msgspec (its CPU shares the box with the
server, as an agent's would). Median of 3 interleaved runs with the spread; load printed.
Besides tokens per wall second, tokens per CPU second of the processes doing the work
(`cpu_ratio`): on a loaded box the wall ratio depends on how the scheduler shares the CPU.
After the runs: the CPU cores each process used during the server runs (median of the runs'
CPU seconds over wall seconds), and each engine's tokens per decode step (rows a step, on
average) and milliseconds per step: at a fixed number of sessions, every millisecond a reply
and the session's next request spend between the engine and the client is a row missing from
the engine's batch. `--core-process` runs the server's engine as `engine.core_process = true`
(the torch engine in a child process of its replica: rl360.serve.engines.core_process).
Threads: both sides run the engine with `--threads` torch threads (default 1: the engine
replica reserves one CPU, `engine.num_cpus = 1`, and Ray starts it with OMP_NUM_THREADS=1).
`--threads 2` makes the server's engine use more than it reserved: libgomp's second thread
spin-waits after every parallel region and takes the core the session server, shard and
client need (measured: ratio 0.32 at 2 threads against 0.6-0.7 at 1), while the tiny model
gains nothing from it in process (10.3k vs 10.6k tok/s).
The last line is
{"bench": "serve_overhead", "ours": <server tok/s>, "baseline": <direct tok/s>, "ratio": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

MESSAGES = [{"role": "system", "content": "You write short Python functions."},
            {"role": "user", "content": "Write add_seven(x) that returns x plus 7."}]
TOOL_RESULT = "exit code 0\n$ python -c 'print(add_seven(1))'\n8"


def tool_message(reply: dict[str, Any]) -> dict[str, Any]:
    calls = reply.get("tool_calls") or []
    return {"role": "tool", "tool_call_id": calls[0]["id"] if calls else "call_0",
            "content": TOOL_RESULT}


def seed(w: int, i: int) -> int:
    return w * 1000 + i


class Direct:
    """The engine backend in this process, fed prompt ids built by hand."""

    def __init__(self, args: argparse.Namespace) -> None:
        from rl360.policies.chat import ChatRenderer
        from rl360.policies.loading import load_tokenizer
        from rl360.recipe import EngineSection, ModelSection
        from rl360.serve.engines.torch_backend import TorchBackend
        from rl360.types import Message

        self.args = args
        self.be = TorchBackend(EngineSection(max_batch_size=64, batch_wait_ms=5.0,
                                             threads=args.threads), ModelSection(path="tiny"))
        self.r = r = ChatRenderer(load_tokenizer("tiny"))
        msgs = [Message(**m) for m in MESSAGES]
        self.first = r.render(msgs, None, add_generation_prompt=True)
        # the tool turn's delta after an assistant reply, rendered once: junction + tool block
        # + generation prompt (what the ledger appends after a reply that ended with EOS)
        ctx = [*msgs, Message(role="assistant", content="x")]
        before = r.render(ctx, None, add_generation_prompt=False)
        after = r.render([*ctx, Message(role="tool", tool_call_id="call_0", content=TOOL_RESULT)],
                         None, add_generation_prompt=True)
        assert after[: len(before)] == before
        eot = before[::-1].index(r.end_of_turn_id)
        self.tool_delta = before[len(before) - eot :] + after[len(before) :]

    async def worker(self, w: int) -> int:
        from rl360.types import SamplingParams

        a, n = self.args, 0
        if a.mode == "retry":
            for i in range(a.requests):
                sp = SamplingParams(temperature=1.0, max_tokens=a.max_tokens, seed=seed(w, i),
                                    eos_token_ids=self.r.eos_ids)
                n += len((await self.be.generate(self.first, sp)).token_ids)
            return n
        ids = list(self.first)
        for t in range(a.turns):
            sp = SamplingParams(temperature=1.0, max_tokens=a.max_tokens, seed=seed(w, t),
                                eos_token_ids=self.r.eos_ids)
            gen = await self.be.generate(ids, sp)
            n += len(gen.token_ids)
            ended = gen.token_ids and gen.token_ids[-1] in self.r.eos_ids
            ids = ids + gen.token_ids + ([] if ended else [self.r.end_of_turn_id]) + self.tool_delta
        return n

    async def run(self, sessions: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(self.worker(w) for w in range(sessions))))
        return time.perf_counter() - t0, tokens


async def through_server(args: argparse.Namespace, base_url: str,
                         sessions: int) -> tuple[float, int]:
    import aiohttp
    import msgspec

    async def post(http: aiohttp.ClientSession, path: str, body: Any,
                   headers: dict[str, str] | None = None) -> Any:
        async with http.post(base_url + path, data=msgspec.json.encode(body),
                             headers={"Content-Type": "application/json", **(headers or {})}) as r:
            raw = await r.read()
            assert r.status in (200, 201), raw[:300]
            return msgspec.json.decode(raw)

    async def worker(http: aiohttp.ClientSession, w: int) -> int:
        s = await post(http, "/sessions", {})
        h = {"Authorization": f"Bearer {s['token']}"}
        url = f"/sessions/{s['id']}/v1/chat/completions"
        n = 0
        msgs = list(MESSAGES)
        steps = args.requests if args.mode == "retry" else args.turns
        for i in range(steps):
            out = await post(http, url, {"messages": msgs, "max_tokens": args.max_tokens,
                                         "temperature": 1.0, "seed": seed(w, i)}, h)
            n += out["usage"]["completion_tokens"]
            if args.mode == "agent":
                reply = out["choices"][0]["message"]
                msgs = [*msgs, reply, tool_message(reply)]
        return n

    conn = aiohttp.TCPConnector(limit=sessions * 2)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(600)) as http:
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(worker(http, w) for w in range(sessions))))
        return time.perf_counter() - t0, tokens


def cpu_seconds(tree: bool) -> dict[int, float]:
    """CPU seconds (user + system) of this process, and with `tree` of every process under
    it (the local Ray cluster: gcs, raylet, Serve proxy and controller, replicas, shards)."""
    import psutil

    me = psutil.Process()
    out: dict[int, float] = {}
    for p in [me, *(me.children(recursive=True) if tree else [])]:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(after[p] - before.get(p, 0.0) for p in after)


def cpu_by_role(before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds per process between two samples, keyed by what the process is (its Ray
    actor title, or its program name): where the server path's CPU goes."""
    import psutil

    out: dict[str, float] = {}
    for pid, c in after.items():
        try:
            proc = psutil.Process(pid)
            cmdline = proc.cmdline()
            title = " ".join(cmdline[:1]) or proc.name()
        except psutil.Error:
            title, cmdline = "?", []
        if "rl360.serve.engines.core_child" in cmdline:
            title = "engine core process"
        elif pid == os.getpid():
            title = "bench (client)"
        elif title.startswith("ray::"):
            title = title.split()[0].split(".")[0]
        else:
            title = os.path.basename(title.split()[0]) if title.strip() else "?"
        out[title] = out.get(title, 0.0) + c - before.get(pid, 0.0)
    return out


def engine_health(recipe: Any) -> dict[str, Any]:
    """The server's engine replica's health (steps, tokens, busy seconds)."""
    from ray import serve

    return serve.get_deployment_handle("engine", app_name=recipe.serve.app_name
                                       ).health.remote().result()


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.0f} (min {min(xs):.0f}, max {max(xs):.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("retry", "agent"), default="retry")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8, help="retry mode: requests per session")
    ap.add_argument("--turns", type=int, default=8, help="agent mode: turns per episode")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the engine, both sides (the replica reserves 1 CPU)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ingress", choices=("proxy", "haproxy"), default="proxy",
                    help="serve.ingress: Serve's Python proxy or its HAProxy ingress")
    ap.add_argument("--core-process", action="store_true",
                    help="engine.core_process = true: the server's torch engine in a child "
                         "process of its replica (its own GIL)")
    args = ap.parse_args()
    per = args.requests if args.mode == "retry" else args.turns
    print(f"workload: mode {args.mode}, {args.sessions} concurrent sessions x {per} "
          f"{'requests' if args.mode == 'retry' else 'turns'}, max_tokens {args.max_tokens}, "
          f"temperature 1.0, seeded; model tiny, torch threads {args.threads}; ingress "
          f"{args.ingress}; engine core process {args.core_process}; "
          f"cpus {os.cpu_count()}; load before {open('/proc/loadavg').read().split()[:3]}")

    from rl360.launch.ingress import check_ingress, ingress_env
    from rl360.launch.serve_app import start_serving, stop_serving
    from rl360.ray_session import ray_session
    from rl360.recipe import apply_overrides, decode_recipe

    loop = asyncio.new_event_loop()  # one loop: the backend's engine task lives on it
    direct = Direct(args)
    loop.run_until_complete(direct.run(1))  # warm up
    recipe = decode_recipe(apply_overrides({}, [
        "engine.max_batch_size=64", "engine.batch_wait_ms=5.0", f"engine.threads={args.threads}",
        "engine.num_cpus=1", f"serve.ingress='{args.ingress}'",
        f"engine.core_process={str(args.core_process).lower()}",
    ]))
    check_ingress(recipe.serve)
    d_runs: list[float] = []
    s_runs: list[float] = []
    d_cpu: list[float] = []  # tokens per CPU second
    s_cpu: list[float] = []
    roles: list[dict[str, float]] = []  # server runs: CPU seconds per process
    with ray_session(num_cpus=2, dashboard=False, namespace="rl360-bench",
                     env_vars=ingress_env(recipe.serve, local=True)):
        h = start_serving(recipe)
        try:
            loop.run_until_complete(through_server(args, h.base_url, 1))  # warm up
            for _ in range(args.runs):  # interleaved: a load swing hits both sides
                c0 = cpu_seconds(tree=False)
                d_s, d_tok = loop.run_until_complete(direct.run(args.sessions))
                d_cpu.append(d_tok / cpu_used(c0, cpu_seconds(tree=False)))
                d_runs.append(d_tok / d_s)
                c0 = cpu_seconds(tree=True)
                s_s, s_tok = loop.run_until_complete(
                    through_server(args, h.base_url, args.sessions))
                c1 = cpu_seconds(tree=True)
                s_cpu.append(s_tok / cpu_used(c0, c1))
                roles.append({k: v / s_s for k, v in cpu_by_role(c0, c1).items()})
                s_runs.append(s_tok / s_s)
                print(f"  run: direct {d_tok} tokens in {d_s:.2f}s ({d_cpu[-1]:.0f} tok/cpu-s), "
                      f"server {s_tok} tokens in {s_s:.2f}s ({s_cpu[-1]:.0f} tok/cpu-s); load "
                      f"{open('/proc/loadavg').read().split()[:3]}", flush=True)
            engines = {"direct": direct.be.health(), "server": engine_health(recipe)}
        finally:
            stop_serving(h)
            loop.run_until_complete(direct.be.close())
    load = open("/proc/loadavg").read().split()[:3]
    rows = {k: e["tokens"] / max(1, e["steps"]) for k, e in engines.items()}
    step_ms = {k: 1e3 * e["busy_s"] / max(1, e["steps"]) for k, e in engines.items()}
    print("engine, all runs with the warm-up: tokens per step (rows a step, on average) direct "
          f"{rows['direct']:.2f}, server {rows['server']:.2f}; ms a step (busy) direct "
          f"{step_ms['direct']:.2f}, server {step_ms['server']:.2f}")
    share = {k: statistics.median(r.get(k, 0.0) for r in roles) for k in roles[0]}
    print("server runs, cores used per process (CPU seconds / wall seconds, median): " + ", ".join(
        f"{k} {v:.2f}" for k, v in sorted(share.items(), key=lambda kv: -kv[1]) if v >= 0.01))
    print(f"direct (backend in process): {spread(d_runs)} tok/s")
    print(f"server (HTTP sessions):      {spread(s_runs)} tok/s")
    print(f"per CPU second: direct {spread(d_cpu)} tok/cpu-s (this process), server "
          f"{spread(s_cpu)} tok/cpu-s (this process, the client, and every process of the "
          "local Ray cluster)")
    print(f"load after {load} (a shared box: figures are noisy; on an oversubscribed box the "
          "server's several processes get more of the CPU than the one direct process, so "
          "the wall-clock ratio flatters the server there and the CPU ratio is the one to read)")
    d, s = statistics.median(d_runs), statistics.median(s_runs)
    print(json.dumps({"bench": "serve_overhead", "mode": args.mode, "ours": round(s, 1),
                      "baseline": round(d, 1), "ratio": round(s / d, 3),
                      "ratio_min": round(min(s_runs) / max(d_runs), 3),
                      "ratio_max": round(max(s_runs) / min(d_runs), 3),
                      "cpu_ratio": round(statistics.median(s_cpu) / statistics.median(d_cpu), 3),
                      "ingress": args.ingress, "core_process": args.core_process,
                      "rows_per_step": {k: round(v, 2) for k, v in rows.items()},
                      "step_ms": {k: round(v, 3) for k, v in step_ms.items()},
                      # generations the server's engine core got over its channel (not Serve)
                      "direct_requests": engines["server"].get("direct_requests", 0),
                      "load": load}))


if __name__ == "__main__":
    main()
