"""Sandbox overhead: the same short Python programs through the same exec server, once inside a
bwrap sandbox and once on the process backend (that server on the host: no namespaces, no
cgroups, no uid change), so the ratio is what the isolation costs and nothing else.

Both sides run the same interpreter binary with the same flags, in the same mode: "warm" (the
default: `python -I -S -c` execs fork from the server's warm template on both sides) and
"cold" (the flags given as `-S -I`, which the server does not fork warm: a fresh interpreter
per exec on both sides). A sandbox is per episode, so its start-up is reported apart: bwrap's
against the process backend's.

Each figure is the median of `--runs` runs of `--n` execs (the halves interleaved so drift on a
shared machine hits both sides alike); the last line is the headline (warm execs):
{"bench": "sandbox", "ours": <ms per exec, bwrap>, "baseline": <ms per exec, process>, ...}

Run: .venv/bin/python bench/sandbox.py [--n 200] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable

from rl360.envs.sandbox import Sandbox, SandboxLimits, build_sandbox
from rl360.envs.sandbox.interp import sandbox_python

MODES = {"warm": ["-I", "-S"], "cold": ["-S", "-I"]}  # same meaning; only -I -S forks warm


def programs(n: int) -> list[str]:
    return [
        f"def f(x):\n    return x * {k % 7 + 2} + {k}\n"
        f"assert f(3) == {3 * (k % 7 + 2) + k}\nprint(sum(f(i) for i in range(50)))"
        for k in range(n)
    ]


async def timed(run: Callable[[str], Awaitable[None]], progs: list[str]) -> list[float]:
    lat = []
    for prog in progs:
        t0 = time.perf_counter()
        await run(prog)
        lat.append(time.perf_counter() - t0)
    return lat


def runner(sb: Sandbox, python: str, flags: list[str]) -> Callable[[str], Awaitable[None]]:
    async def run(prog: str) -> None:
        res = await sb.exec([python, *flags, "-c", prog])
        if not res.ok:
            raise RuntimeError(f"{sb.backend} exec failed: {res}")
    return run


async def start_ms(backend: str, python: str, limits: SandboxLimits, n: int = 10) -> float:
    """Median start-up of a sandbox (ready to exec), ms."""
    starts = []
    for _ in range(n):
        sb = build_sandbox(backend, limits, python=python)
        t0 = time.perf_counter()
        await sb.start()
        starts.append(time.perf_counter() - t0)
        await sb.close()
    return statistics.median(starts) * 1000


async def one_run(python: str, progs: list[str], limits: SandboxLimits) -> dict[str, float]:
    """Mean ms per exec for each (backend, mode) over `progs`, plus warm 2-worker execs/s."""
    out: dict[str, float] = {}
    boxes = {b: build_sandbox(b, limits, python=python) for b in ("bwrap", "process")}
    for sb in boxes.values():
        await sb.start()
    try:
        half = len(progs) // 2
        for mode, flags in MODES.items():
            run = {b: runner(sb, python, flags) for b, sb in boxes.items()}
            for b in run:  # warm up both
                await timed(run[b], progs[:5])
            lat: dict[str, list[float]] = {"bwrap": [], "process": []}
            lat["process"] += await timed(run["process"], progs[:half])
            lat["bwrap"] += await timed(run["bwrap"], progs[:half])
            lat["bwrap"] += await timed(run["bwrap"], progs[half:])
            lat["process"] += await timed(run["process"], progs[half:])
            for b, xs in lat.items():
                out[f"{b}_{mode}_ms"] = statistics.fmean(xs) * 1000
            if mode == "warm":
                warm = sorted(lat["bwrap"])
                out["bwrap_warm_p95_ms"] = warm[int(0.95 * (len(warm) - 1))] * 1000
    finally:
        for sb in boxes.values():
            await sb.close()
    # 2 concurrent workers, each with its own sandbox (two episodes), warm execs
    for b in ("bwrap", "process"):
        pair = [build_sandbox(b, limits, python=python) for _ in range(2)]
        for sb in pair:
            await sb.start()
        try:
            runs = [runner(sb, python, MODES["warm"]) for sb in pair]
            t0 = time.perf_counter()
            await asyncio.gather(*[timed(runs[w], progs[w::2]) for w in range(2)])
            out[f"{b}_2workers_per_s"] = len(progs) / (time.perf_counter() - t0)
        finally:
            for sb in pair:
                await sb.close()
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    python = sandbox_python().executable  # one binary both sides can run
    progs = programs(args.n)
    limits = SandboxLimits(timeout=30)
    print(f"workload: {args.n} short programs (a function, an assert, a sum over 50 calls), "
          f"{args.runs} runs, medians; interpreter {python}")
    starts = {b: await start_ms(b, python, limits) for b in ("bwrap", "process")}
    runs = [await one_run(python, progs, limits) for _ in range(args.runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"sandbox start (median of 10, once per episode): bwrap {starts['bwrap']:.1f} ms, "
          f"process {starts['process']:.1f} ms")
    for mode in MODES:
        b, p = med[f"bwrap_{mode}_ms"], med[f"process_{mode}_ms"]
        print(f"{mode} execs ({' '.join(MODES[mode])}): bwrap {b:.2f} ms, process {p:.2f} ms "
              f"per exec, ratio {b / p:.3f}")
    print(f"bwrap warm p95 {med['bwrap_warm_p95_ms']:.2f} ms; 2 workers (warm): bwrap "
          f"{med['bwrap_2workers_per_s']:.1f} execs/s, process "
          f"{med['process_2workers_per_s']:.1f} execs/s")
    ours, base = med["bwrap_warm_ms"], med["process_warm_ms"]
    print(json.dumps({
        "bench": "sandbox", "ours": round(ours, 3), "baseline": round(base, 3),
        "ratio": round(ours / base, 3),
        "cold_ratio": round(med["bwrap_cold_ms"] / med["process_cold_ms"], 3),
        "start_ms": {k: round(v, 1) for k, v in starts.items()},
    }))


if __name__ == "__main__":
    asyncio.run(main())
