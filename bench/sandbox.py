"""Sandbox overhead: the same 200 short Python programs run in a bwrap sandbox and as bare
subprocesses (same resolved interpreter, same `-I -S` flags, output captured both ways).

A sandbox is per episode, so one sandbox runs many execs; its start-up cost is reported on its
own. Prints per-exec latency of each, execs/s on 2 concurrent workers, and as its last line:
{"bench": "sandbox", "ours": <ms per exec bwrap>, "baseline": <ms per exec bare>, "ratio": ...}

Run: .venv/bin/python bench/sandbox.py [--n 200] [--backend bwrap]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable

from rl360.envs.sandbox import SandboxLimits, build_sandbox
from rl360.envs.sandbox.interp import resolve_python

FLAGS = ["-I", "-S"]


def programs(n: int) -> list[str]:
    return [
        f"def f(x):\n    return x * {k % 7 + 2} + {k}\n"
        f"assert f(3) == {3 * (k % 7 + 2) + k}\nprint(sum(f(i) for i in range(50)))"
        for k in range(n)
    ]


async def bare_exec(python: str, prog: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        python,
        *FLAGS,
        "-c",
        prog,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"bare exec failed: {proc.returncode}")
    return out.decode()


async def timed(run: Callable[[str], Awaitable[str]], progs: list[str]) -> list[float]:
    lat = []
    for prog in progs:
        t0 = time.perf_counter()
        await run(prog)
        lat.append(time.perf_counter() - t0)
    return lat


def describe(name: str, lat: list[float]) -> str:
    ms = sorted(x * 1000 for x in lat)
    p95 = ms[int(0.95 * (len(ms) - 1))]
    return (
        f"{name:<16} mean {statistics.fmean(ms):6.2f} ms  p50 {statistics.median(ms):6.2f} ms  "
        f"p95 {p95:6.2f} ms  ({len(ms)} execs)"
    )


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--backend", default="bwrap")
    args = ap.parse_args()
    python = resolve_python().executable
    progs = programs(args.n)
    limits = SandboxLimits(timeout=30)

    async def in_sandbox(sb, prog: str) -> str:  # type: ignore[no-untyped-def]
        res = await sb.exec([python, *FLAGS, "-c", prog])
        if not res.ok:
            raise RuntimeError(f"sandbox exec failed: {res}")
        return res.stdout

    # start-up cost, paid once per episode
    starts = []
    for _ in range(10):
        sb = build_sandbox(args.backend, limits)
        t0 = time.perf_counter()
        await sb.start()
        starts.append(time.perf_counter() - t0)
        await sb.close()

    sb = build_sandbox(args.backend, limits)
    await sb.start()
    bare_fn = lambda p: bare_exec(python, p)  # noqa: E731
    sb_fn = lambda p: in_sandbox(sb, p)  # noqa: E731
    await timed(bare_fn, progs[:10])  # warm both
    await timed(sb_fn, progs[:10])
    # interleave halves so drift on a shared machine hits both sides alike
    half = len(progs) // 2
    bare = await timed(bare_fn, progs[:half])
    ours = await timed(sb_fn, progs[:half])
    ours += await timed(sb_fn, progs[half:])
    bare += await timed(bare_fn, progs[half:])
    await sb.close()

    # 2 concurrent workers, each with its own sandbox (two episodes)
    async def throughput(
        make_run: Callable[[int], Awaitable[Callable[[str], Awaitable[str]]]],
    ) -> float:
        runs = [await make_run(w) for w in range(2)]
        t0 = time.perf_counter()
        await asyncio.gather(*[timed(runs[w], progs[w::2]) for w in range(2)])
        return len(progs) / (time.perf_counter() - t0)

    boxes = [build_sandbox(args.backend, limits) for _ in range(2)]
    for b in boxes:
        await b.start()

    async def make_sb(w: int) -> Callable[[str], Awaitable[str]]:
        return lambda p: in_sandbox(boxes[w], p)

    async def make_bare(w: int) -> Callable[[str], Awaitable[str]]:
        return bare_fn

    tput_bare = await throughput(make_bare)
    tput_ours = await throughput(make_sb)
    for b in boxes:
        await b.close()

    print(f"interpreter: {python} {' '.join(FLAGS)}")
    print(
        f"sandbox start ({args.backend}): mean {statistics.fmean(starts) * 1000:.1f} ms (once per episode)"
    )
    print(describe(f"{args.backend} sandbox", ours))
    print(describe("bare subprocess", bare))
    print(f"2 workers: {args.backend} {tput_ours:.1f} execs/s, bare {tput_bare:.1f} execs/s")
    ours_ms = statistics.fmean(ours) * 1000
    base_ms = statistics.fmean(bare) * 1000
    print(
        json.dumps(
            {
                "bench": "sandbox",
                "ours": round(ours_ms, 3),
                "baseline": round(base_ms, 3),
                "ratio": round(ours_ms / base_ms, 3),
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
