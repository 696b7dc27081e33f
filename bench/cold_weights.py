"""How much slower is the first decode step on a new weight version? A decode step reads every
weight once; a small model's weights can stay in the last-level cache between steps (on a
machine whose L3 is larger than the model), and a version just swapped in is not there yet. This is the part of an
in-flight swap's pause (`bench/async_speedup.py`) that no engine work removes: the step after a
swap is a decode step on weights that come from memory.

Work: the matrices of `bench/async_speedup.py`'s policy (hidden 768, 4 layers, intermediate
2048: 113 MB fp32), a decode-like pass = one single-thread matmul of `--rows` vectors by every
matrix, pinned to one core. Per round: three passes on version A (warm), then the first pass on
version B, a copy of A made earlier and pushed out of the cache by a 400 MB sweep (cold), then
its second pass. Median of `--runs` rounds.

    .venv/bin/python bench/cold_weights.py [--runs 5] [--rows 5]

Last line: {"bench": "cold_weights", "ours": <first pass on the new version, ms>,
 "baseline": <a warm pass, ms>, "ratio": ours / baseline, "second_ms": ...}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def matrices(hidden: int, layers: int, inter: int) -> list[torch.Tensor]:
    out = []
    for _ in range(layers):
        out += [torch.randn(hidden, hidden) for _ in range(4)]  # q, k, v, o
        out += [torch.randn(inter, hidden) for _ in range(2)] + [torch.randn(hidden, inter)]
    return out


def decode_pass(ws: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> float:
    """Milliseconds for one matmul of the rows by every matrix (reads every weight once)."""
    t = time.perf_counter()
    for w in ws:
        xs[w.shape[1]] @ w.T
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rows", type=int, default=5, help="sequences decoded together")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    a = matrices(768, 4, 2048)
    b = [w.clone() for w in a]
    flush = torch.ones(100_000_000)  # 400 MB: sweeping it pushes a version out of the cache
    xs = {n: torch.randn(args.rows, n) for n in (768, 2048)}
    mb = sum(w.numel() * w.element_size() for w in a) / 1e6
    print(f"workload: {len(a)} matrices, {mb:.0f} MB fp32, {args.rows} rows, one thread on "
          f"one core, {args.runs} rounds")
    warm, cold, second = [], [], []
    for _ in range(args.runs):
        flush.sum()
        for _ in range(3):
            w = decode_pass(a, xs)
        warm.append(w)  # the third pass on A: as warm as a run's steady state
        cold.append(decode_pass(b, xs))
        second.append(decode_pass(b, xs))
        a, b = b, a
    m = {k: statistics.median(v) for k, v in (("warm", warm), ("cold", cold),
                                               ("second", second))}
    print(f"warm pass {m['warm']:.2f} ms ({min(warm):.2f}-{max(warm):.2f}); first pass on the "
          f"new version {m['cold']:.2f} ms ({min(cold):.2f}-{max(cold):.2f}); second "
          f"{m['second']:.2f} ms")
    print(json.dumps({"bench": "cold_weights", "ours": round(m["cold"], 3),
                      "baseline": round(m["warm"], 3), "ratio": round(m["cold"] / m["warm"], 3),
                      "second_ms": round(m["second"], 3), "mb": round(mb, 1),
                      "rows": args.rows, "runs": args.runs}))


if __name__ == "__main__":
    main()
