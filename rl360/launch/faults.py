"""Fault drills: `train.inject_faults = ["env_actor@2", ...]` kills one part of a running
`rl360 train` right after the named step (tests/launch/test_faults.py, bench/faults.py).

Every part is killed through Ray (`ray.kill(handle, no_restart=False)`), the way a crashed
process looks to the rest of the run; each is restarted (Ray's `max_restarts`, or Serve for an
engine replica) and the run must continue losing no task. Which one was killed and when is a
`fault` row of the run's ledger (rl360.actors.run_ledger).

`engine_stall` is a hung replica rather than a dead one: the first registered engine replica's
process is stopped (SIGSTOP; on this node) just before step N's weight sync, which must name it
within its timeout and follow the fault rules (train.weight_sync.on_failure: replace it, or
stop the run).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import ray

FAULT_PARTS = ("env_actor", "engine", "engine_stall", "shard", "publisher")
BEFORE_SYNC = ("engine_stall",)  # injected before the step's weight sync, not after the step


def faults_after(specs: list[str], step: int) -> list[str]:
    """The parts to kill after `step` ("part@N" specs, checked by the recipe)."""
    return [p for p in _at(specs, step) if p not in BEFORE_SYNC]


def faults_before_sync(specs: list[str], step: int) -> list[str]:
    """The parts to stall just before `step`'s weight sync."""
    return [p for p in _at(specs, step) if p in BEFORE_SYNC]


def _at(specs: list[str], step: int) -> list[str]:
    return [s.split("@")[0] for s in specs if int(s.split("@")[1]) == step]


def engine_replica_names(app_name: str, deployment: str = "engine") -> list[str]:
    """The Ray actor names of a Serve deployment's replicas (namespace "serve")."""
    marker = f"{app_name}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::") and marker in a["name"])


def inject(part: str, stack: Any) -> str:
    """Kill one `part` of the running stack (the first of its kind); returns what was killed."""
    if part == "env_actor":
        assert stack.pool is not None
        ray.kill(stack.pool.actors[0], no_restart=False)
        return "rl360-env-0"
    if part == "shard":
        ray.kill(stack.serving.shards[0], no_restart=False)
        return stack.serving.shard_names[0]
    if part == "publisher":
        ray.kill(stack.serving.publisher, no_restart=False)
        return stack.serving.publisher_name
    if part == "engine":
        names = engine_replica_names(stack.serving.app_name)
        if not names:
            raise RuntimeError("fault drill: no engine replica found to kill")
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=False)
        return names[0]
    if part == "engine_stall":
        members = ray.get(stack.serving.publisher.members.remote())
        if not members:
            raise RuntimeError("fault drill: no engine replica registered to stall")
        replica = sorted(members)[0]
        os.kill(int(members[replica]["pid"]), signal.SIGSTOP)  # killed later by the run
        return replica
    raise ValueError(f"train.inject_faults: unknown part {part!r} (one of {FAULT_PARTS})")
