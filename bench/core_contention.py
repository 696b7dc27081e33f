"""Do two cores of this machine slow each other down? `bench/async_speedup.py` emulates a
rollout machine and a trainer machine by pinning them to core 0 and core 1; that only holds if
work on one core leaves the other's speed alone (it does not when the two are SMT siblings of
one physical core, or share a saturated memory bus, which a VM's guest cannot see).

A single-thread fp32 matmul (the trainer's kind of work) runs on core 1 for `--seconds`: alone,
beside the same matmul on core 0, and beside a memory-streaming copy on core 0 (the engine's
decode kind); median of `--runs` rounds, each running the three in turn.

    .venv/bin/python bench/core_contention.py [--runs 3] [--seconds 3]

Last line: {"bench": "core_contention", "alone": GFLOP/s, "beside_matmul": ..., "beside_copy":
..., "ratio_matmul": beside/alone, "ratio_copy": ...}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

# what runs on core 0 while core 1 is measured (None: nothing)
WORKLOADS: dict[str, str | None] = {"alone": None, "beside_matmul": "matmul", "beside_copy": "copy"}


def matmul_rate(seconds: float) -> float:
    """GFLOP/s of a 1024x768 @ 768x2048 fp32 matmul on one thread, over `seconds`."""
    a, w = torch.randn(1024, 768), torch.randn(768, 2048)
    a @ w
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ w
        n += 1
    return 2 * 1024 * 768 * 2048 * n / (time.perf_counter() - t0) / 1e9


def load(kind: str) -> None:
    """Run forever on core 0: the matmul, or a 64 MB copy (memory bound)."""
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    if kind == "matmul":
        a, w = torch.randn(1024, 768), torch.randn(768, 2048)
        while True:
            a @ w
    x = torch.empty(16 * 1024 * 1024)
    y = torch.empty_like(x)
    while True:
        y.copy_(x)


def measure(beside: str | None, seconds: float) -> float:
    if beside is None:
        return matmul_rate(seconds)
    proc = subprocess.Popen([sys.executable, __file__, "--load", beside])
    try:
        time.sleep(1.0)  # the load is running
        return matmul_rate(seconds)
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--load", choices=("matmul", "copy"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load:
        load(args.load)
        return
    if not {0, 1} <= os.sched_getaffinity(0):
        raise SystemExit("core_contention: needs cores 0 and 1")
    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    with open("/proc/loadavg") as f:
        print(f"workload: one-thread fp32 matmul (1024x768 @ 768x2048) on core 1 for "
              f"{args.seconds:g} s, alone / beside the same matmul on core 0 / beside a 64 MB "
              f"copy loop on core 0; {args.runs} alternating rounds; load {f.read().split()[0]}")
    got: dict[str, list[float]] = {k: [] for k in WORKLOADS}
    for _ in range(args.runs):
        for kind, beside in WORKLOADS.items():
            got[kind].append(measure(beside, args.seconds))
    med = {k: statistics.median(v) for k, v in got.items()}
    for k, v in got.items():
        print(f"  {k:14s} {med[k]:6.1f} GFLOP/s [{min(v):.1f}-{max(v):.1f}]")
    print(json.dumps({"bench": "core_contention", **{k: round(v, 2) for k, v in med.items()},
                      "ratio_matmul": round(med["beside_matmul"] / med["alone"], 3),
                      "ratio_copy": round(med["beside_copy"] / med["alone"], 3)}))


if __name__ == "__main__":
    main()
