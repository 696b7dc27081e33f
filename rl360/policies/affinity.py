"""CPU placement for the processes that ask for it: pinning (`engine`, `trainer`, `env`
`cpu_affinity`) and scheduling priority (`engine.nice`, `trainer.nice`).

Torch-free on purpose: env actors pin themselves too, and importing torch there would cost
every env actor seconds of start-up for nothing.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("rl360.affinity")


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


def set_niceness(nice: int, key: str) -> bool:
    """Give every thread of this process the scheduling niceness `nice` (Linux keeps it per
    thread; threads and processes started later inherit it).

    Ray starts its workers at niceness 15, below its own raylet, GCS and dashboard at 0: on a
    busy core an engine or trainer rank then gets ~1/28 of the CPU whenever one of those runs
    (measured on 2 cores: the decode step right after a weight swap took 2-3x its CPU time while
    the new batch's control-plane traffic ran). Raising the priority back (a lower niceness)
    needs CAP_SYS_NICE or RLIMIT_NICE; without it this logs one warning naming `key` and leaves
    the niceness as it is (returns False)."""
    if not hasattr(os, "setpriority"):
        return False
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
    except PermissionError:
        log.warning("%s = %d: not permitted here (needs CAP_SYS_NICE or RLIMIT_NICE); this "
                    "process stays at niceness %d", key, nice, os.getpriority(os.PRIO_PROCESS, 0))
        return False
    return True
