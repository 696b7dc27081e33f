"""The engine replica's side of a collective weight sync (called by
rl360.weights.follow.follow_weights).

Engines with a weight group of their own (SGLang: `Intake.own_group`) get the update as a
description (CollectiveUpdate / IpcUpdate) and receive it inside their workers; other engines
(the torch backend) receive here, into tensors on this replica's GPU (or CPU over gloo), through
rl360.weights.nccl.GroupReceiver or rl360.weights.gloo.GlooGroup, and then apply a plain
name -> tensor TensorUpdate.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from rl360.weights.gloo import GlooGroup
from rl360.weights.nccl import GroupReceiver, gpu_uuid, load_ipc
from rl360.weights.payloads import CollectiveUpdate, IpcUpdate, TensorUpdate, WeightUpdate
from rl360.weights.receiver import Intake


def replica_info(intake: Intake) -> dict[str, Any]:
    """What the transport needs to plan a group: ranks this replica takes, the layout it
    receives, its GPU's UUID ("" without one), its Ray actor's name and namespace ("" outside
    a named actor: a sharded sync checks that the actor lives, and replaces it) and its
    process id (the engine_stall fault drill)."""
    own = intake.own_group
    return {"width": intake.group_width if own else 1,
            "layout": "per_tensor" if own else "flat", "gpu": gpu_uuid(), **_actor()}


def _actor() -> dict[str, str]:
    try:
        import ray

        ctx = ray.get_runtime_context()
        name = ctx.get_actor_name() if ray.is_initialized() else None
        return {"actor": name or "", "namespace": _namespace(name, ctx) if name else "",
                "pid": os.getpid()}
    except Exception:
        return {"actor": "", "namespace": "", "pid": os.getpid()}


async def gpu_state(payload: dict[str, Any], intake: Intake, rank: int,
                    receiver: Any) -> tuple[WeightUpdate, Any]:
    """A planned version (buckets over a named group, or CUDA IPC): (the update for the
    engine, the receiver to keep for the next version)."""
    if payload["backend"] == "ipc":
        if intake.own_group:
            return IpcUpdate(list(payload["ipc"][:intake.group_width])), receiver
        # the sender keeps these alive until every replica has applied (copied) them
        return TensorUpdate(await asyncio.to_thread(load_ipc, payload["ipc"][0])), receiver
    if intake.own_group:
        join = (payload["host"], int(payload["port"]), rank, int(payload["world"]),
                payload["backend"])
        return CollectiveUpdate(group_name=payload["group_name"], buckets=payload["buckets"],
                                join=join), receiver
    if receiver is None or getattr(receiver, "group_name", None) != payload["group_name"]:
        receiver = await asyncio.to_thread(
            GroupReceiver, payload["host"], int(payload["port"]), int(payload["world"]), rank,
            payload["backend"], payload["group_name"])
        receiver.group_name = payload["group_name"]
    state = await asyncio.to_thread(receiver.receive, payload["buckets"], payload["layout"])
    return TensorUpdate(state), receiver


async def gloo_state(payload: dict[str, Any], rank: int, group: GlooGroup | None
                     ) -> tuple[TensorUpdate, GlooGroup]:
    """A version over the CPU gloo group (joined at the first one): (the update, the group)."""
    if group is None:
        group = await asyncio.to_thread(GlooGroup, payload["host"], payload["port"], rank,
                                        payload["world"])
    return TensorUpdate(await asyncio.to_thread(group.receive, payload["spec"])), group


def sent_names(payload: dict[str, Any]) -> list[str]:
    """The names of the tensors a collective version carried."""
    if payload.get("names"):
        return list(payload["names"])
    if payload.get("buckets"):
        return [n for b in payload["buckets"] for n, _, _ in b]
    return [n for n, _, _ in payload.get("spec", [])]


def _namespace(name: str, ctx: Any) -> str:
    """The namespace this named actor lives in: the job's, or Serve's ("serve") for a Serve
    replica, which the runtime context does not tell apart."""
    import ray

    me = ctx.get_actor_id()
    for ns in (ctx.namespace, "serve"):
        try:
            if ray.get_actor(name, namespace=ns)._actor_id.hex() == me:
                return str(ns)
        except ValueError:
            continue
    return ""
