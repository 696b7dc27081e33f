"""CPU pinning for the processes that ask for it (`engine`, `trainer`, `env` `cpu_affinity`).

Torch-free on purpose: env actors pin themselves too, and importing torch there would cost
every env actor seconds of start-up for nothing.
"""

from __future__ import annotations

import os


def pin_to_cpus(cpus: list[int], key: str) -> None:
    """Pin every thread of this process to `cpus` (threads started later inherit it); no-op
    for []. `key` names the recipe setting in the one-line error."""
    if not cpus:
        return
    have = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{key}: CPU pinning needs Linux (os.sched_setaffinity)")
    missing = sorted(set(cpus) - set(range(os.cpu_count() or 0)))
    if missing:
        raise ValueError(f"{key}: no CPU core {missing[0]} on this host "
                         f"(cores 0-{(os.cpu_count() or 1) - 1}; this process may use {sorted(have)})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), set(cpus))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
