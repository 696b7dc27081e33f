"""The engine replica's side of a GPU weight sync (called by rl360.weights.publisher.follow_weights).

Engines with a weight group of their own (SGLang: `join_weight_group`) get the update as a
description (CollectiveUpdate / IpcUpdate) and receive it inside their workers; other engines
(the torch backend on a GPU) receive here, into tensors on this replica's GPU, through
rl360.weights.nccl.WeightReceiver, and then apply a plain name -> tensor dict.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rl360.serve.engines.sglang_backend import CollectiveUpdate, IpcUpdate
from rl360.weights.nccl import WeightReceiver, gpu_uuid, load_ipc
from rl360.weights.plan import checksum_state


def has_own_group(backend: Any) -> bool:
    return callable(getattr(backend, "join_weight_group", None))


def replica_info(backend: Any) -> dict[str, Any]:
    """What the transport needs to plan a group: ranks this replica takes, the layout it
    receives, and its GPU's UUID ("" without one)."""

    own = has_own_group(backend)
    return {"width": int(getattr(backend, "weight_group_width", 1)) if own else 1,
            "layout": "per_tensor" if own else "flat", "gpu": gpu_uuid()}


async def gpu_state(payload: dict[str, Any], backend: Any, rank: int,
                    receiver: Any) -> tuple[Any, Any]:
    """(what to pass to backend.update_weights, the receiver to keep for the next version)."""
    if payload["backend"] == "ipc":
        if has_own_group(backend):

            width = int(getattr(backend, "weight_group_width", 1))
            return IpcUpdate(serialized_per_rank=list(payload["ipc"][:width])), receiver

        # the sender keeps these alive until every replica has applied (copied) them
        return await asyncio.to_thread(load_ipc, payload["ipc"][0]), receiver
    if has_own_group(backend):

        join = (payload["host"], int(payload["port"]), rank, int(payload["world"]),
                payload["backend"])
        return CollectiveUpdate(group_name=payload["group_name"], buckets=payload["buckets"],
                                join=join), receiver

    if receiver is None or getattr(receiver, "group_name", None) != payload["group_name"]:
        receiver = await asyncio.to_thread(
            WeightReceiver, payload["host"], int(payload["port"]), int(payload["world"]), rank,
            payload["backend"], payload["group_name"])
        receiver.group_name = payload["group_name"]
    state = await asyncio.to_thread(receiver.receive, payload["buckets"], payload["layout"])
    return state, receiver


def _sent_names(payload: dict[str, Any]) -> list[str]:
    if payload.get("names"):
        return list(payload["names"])
    if payload.get("buckets"):
        return [n for b in payload["buckets"] for n, _, _ in b]
    return [n for n, _, _ in payload.get("spec", [])]


async def engine_checksums(backend: Any, payload: dict[str, Any], state: Any) -> dict[str, Any]:
    """{"dtype": ..., "sums": {name: [elements compared or None, checksum]}} of what the
    engine now serves (the debug option `checksum`)."""

    names = _sent_names(payload)
    if callable(getattr(backend, "weight_checksums", None)):  # SGLang: prefixes via its API
        sums = await backend.weight_checksums(names)
        return {"dtype": f"torch.{backend.config.dtype}",
                "sums": {n: [lim, value] for n, (lim, value) in sums.items()}}
    model = getattr(backend, "model", None)
    held = model.state_dict() if model is not None else (state if isinstance(state, dict) else {})
    tensors = {n: held[n] for n in names if n in held}
    dtype = str(next(iter(tensors.values())).dtype) if tensors else None
    sums = await asyncio.to_thread(checksum_state, tensors)
    return {"dtype": dtype, "sums": {n: [None, v] for n, v in sums.items()}}
