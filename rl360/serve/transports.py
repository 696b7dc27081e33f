"""Weight transports: how a new policy version reaches every engine replica.

Both sit behind `WeightTransport.publish(version)` and both announce the version through the
WeightPublisher actor, which the replicas long-poll (rl360.serve.weights.follow_weights):

- "object_store": the trainer's rank 0 returns its state dict as a Ray object (put once);
  each replica fetches it from the object store (zero-copy on the same node).
- "collective": a gloo group (NCCL on GPUs) of the sender (rank 0) and every engine replica;
  the weights are flattened into one buffer per dtype and broadcast, then unflattened on the
  replicas. No object store copy at all.
"""

from __future__ import annotations

import socket
from typing import Any, Protocol

import torch

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64)}


class WeightTransport(Protocol):
    def publish(self, version: int) -> bool: ...


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tensor_spec(state: dict[str, torch.Tensor]) -> list[tuple[str, list[int], str]]:
    return [(k, list(v.shape), str(v.dtype)) for k, v in state.items()]


def flatten(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One contiguous buffer per dtype, tensors in the state dict's order."""
    groups: dict[str, list[torch.Tensor]] = {}
    for v in state.values():
        groups.setdefault(str(v.dtype), []).append(v.detach().reshape(-1))
    return {d: torch.cat(ts) for d, ts in groups.items()}


def unflatten(spec: list[tuple[str, list[int], str]], buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    offsets = dict.fromkeys(buffers, 0)
    for name, shape, dtype in spec:
        n = 1
        for d in shape:
            n *= d
        out[name] = buffers[dtype][offsets[dtype] : offsets[dtype] + n].view(shape)
        offsets[dtype] += n
    return out


def buffer_sizes(spec: list[tuple[str, list[int], str]]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for _, shape, dtype in spec:
        n = 1
        for d in shape:
            n *= d
        sizes[dtype] = sizes.get(dtype, 0) + n
    return sizes


class GlooGroup:
    """A torch.distributed gloo process group of its own (no default group needed), so a
    trainer rank and Serve replicas can join one without disturbing their other groups."""

    def __init__(self, host: str, port: int, rank: int, world: int, timeout_s: float = 300.0) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self.rank, self.world = rank, world
        store = dist.TCPStore(host, port, world, is_master=rank == 0,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        self.pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))

    def broadcast(self, buffers: dict[str, torch.Tensor]) -> None:
        for d in sorted(buffers):
            self.pg.broadcast(buffers[d], 0).wait()

    def send(self, state: dict[str, torch.Tensor]) -> None:
        self.broadcast(flatten(state))

    def receive(self, spec: list[tuple[str, list[int], str]]) -> dict[str, torch.Tensor]:
        bufs = {d: torch.empty(n, dtype=_DTYPES[d]) for d, n in buffer_sizes(spec).items()}
        self.broadcast(bufs)
        return unflatten(spec, bufs)


class ObjectStoreTransport:
    """Rank 0's state dict goes into the object store once; replicas fetch it."""

    def __init__(self, serving: Any, trainer: Any) -> None:
        self.serving, self.trainer = serving, trainer

    def publish(self, version: int) -> bool:
        return self.serving.publish_ref(version, self.trainer.state_dict_ref())


class CollectiveTransport:
    """Broadcast from a sender holding the weights to every engine replica over gloo.

    `sender` is anything with `open_group(host, port, world)` and `send_weights()` remote
    methods (the trainer's rank 0 worker, or a bench's stand-in)."""

    def __init__(self, serving: Any, sender: Any, replicas: int, host: str = "127.0.0.1") -> None:
        self.serving, self.sender = serving, sender
        self.replicas, self.host = replicas, host
        self.port = 0
        self.spec: list[tuple[str, list[int], str]] | None = None

    def publish(self, version: int) -> bool:
        import ray

        pub = self.serving.publisher
        if not self.port:
            ranks = ray.get(pub.wait_registered.remote(self.replicas, 300.0))
            self.port = free_port(self.host)
            self.spec = ray.get(self.sender.weight_spec.remote())
            payload = {"kind": "collective", "host": self.host, "port": self.port,
                       "world": self.replicas + 1, "ranks": ranks, "spec": self.spec}
            joined = self.sender.open_group.remote(self.host, self.port, self.replicas + 1)
            if not ray.get(pub.publish_collective.remote(version, payload)):
                return False
            ray.get(joined)
        else:
            payload = {"kind": "collective", "host": self.host, "port": self.port,
                       "world": self.replicas + 1, "spec": self.spec}
            if not ray.get(pub.publish_collective.remote(version, payload)):
                return False
        ray.get(self.sender.send_weights.remote())
        return True


TRANSPORTS = {"object_store": ObjectStoreTransport, "collective": CollectiveTransport}
