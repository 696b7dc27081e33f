"""Collective weight sync on GPUs: an NCCL group from trainer rank 0 to the engine workers,
bucketed broadcast, and CUDA IPC when the trainer and an engine share one GPU.

The group is a process group of its own (TCPStore at the sender, keys under a PrefixStore named
after the group), made the way SGLang's and vLLM's `init_weights_update_group` make theirs, so
trainer rank 0 (rank 0), our own receivers and SGLang's TP workers (ranks rank_offset..) can all
be members of one group. It never touches the default process group of either side.

Layouts (rl360.recipe.CollectiveSync.layout):
- "per_tensor": each tensor of a bucket is broadcast on its own, in spec order; what SGLang's
  `update_weights_from_distributed(names, dtypes, shapes)` receives (one call per bucket).
- "flat": a bucket is packed into one buffer per dtype (fewer, larger NCCL calls); for our own
  receivers (torch engines on GPUs).

CUDA IPC instead of NCCL, when ALL of these hold (checked with device UUIDs, so different
CUDA_VISIBLE_DEVICES numbering does not fool it):
- the sender and the engine worker use the same physical GPU (colocated training and rollout;
  NCCL refuses two ranks on one device);
- both processes are on one node and may open each other's CUDA IPC handles (same container or
  --ipc=host; not under MIG or a driver that forbids IPC);
- both see that GPU under the same CUDA device index (a handle is opened on the index it was
  made on; Ray's colocated placement gives both actors the same CUDA_VISIBLE_DEVICES);
- the sender keeps the shared tensors alive until every engine has applied them (GroupSender
  holds them until the next send or `release_ipc()`); the shared copy is the whole state on
  that GPU, so colocation needs room for one extra copy of the weights.

Everything here that needs a GPU raises a clear error without one; the planning, name mapping
and checksums it uses are CPU code in rl360.weights.plan.
"""

from __future__ import annotations

import inspect
import io
import logging
import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from rl360.weights.plan import NameMap, Spec, checksum_state, plan_buckets

log = logging.getLogger("rl360.weights.nccl")


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA GPU (torch.cuda.is_available() is False); "
                           "use train.weight_sync.backend='gloo' on CPU machines")


def gpu_uuid(device: int | None = None) -> str:
    """The physical GPU's UUID ("" without CUDA): equal UUIDs = the same device."""
    if not torch.cuda.is_available():
        return ""
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None
                                             else device)
    return str(getattr(props, "uuid", ""))


def init_weight_group(backend: str, host: str, port: int, world: int, rank: int,
                      group_name: str, timeout_s: float = 1800.0) -> Any:
    """Join (rank 0: host) a standalone process group of `world` ranks. The timeout also
    bounds one broadcast: an engine drains its running generations before it receives, so it
    is as long as SGLang's own default (30 min)."""
    from torch.distributed import distributed_c10d as c10d

    if backend == "nccl":
        require_cuda("an NCCL weight group")
    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(c10d.rendezvous(f"tcp://{host}:{port}", rank, world,
                                              timeout=timeout))
    store.set_timeout(timeout)
    return group_over_store(backend, store, rank, world, group_name, timeout_s)


def group_over_store(backend: str, store: Any, rank: int, world: int, group_name: str,
                     timeout_s: float) -> Any:
    """A standalone process group of `world` ranks over a rendezvous `store` (its keys under
    `group_name`); never the default group."""
    from torch.distributed import distributed_c10d as c10d

    if backend == "nccl":
        require_cuda("an NCCL weight group")
    timeout = timedelta(seconds=timeout_s)
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    opts = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(backend), store,
                                           group_name=group_name, timeout=timeout,
                                           **{opts: None})
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def close_weight_group(pg: Any) -> None:
    """Leave a group made by init_weight_group (frees its name for a later group)."""
    import torch.distributed as dist

    if pg is not None:
        try:
            dist.destroy_process_group(pg)
        except Exception as exc:  # best effort: the peer may be gone already
            log.warning("weight group teardown: %r", exc)


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
        else torch.device("cpu")


def broadcast_bucket(pg: Any, tensors: list[torch.Tensor], layout: str, backend: str) -> None:
    """Sender side of one bucket (rank 0)."""
    dev = _device(backend)
    if layout == "per_tensor":
        keep = [t.detach().to(dev).contiguous() for t in tensors]
        works = [pg.broadcast(t, 0) for t in keep]
    else:
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault(t.dtype, []).append(t.detach().reshape(-1).to(dev))
        keep = [torch.cat(ts) for _, ts in sorted(groups.items(), key=lambda kv: str(kv[0]))]
        works = [pg.broadcast(b, 0) for b in keep]
    for w in works:
        w.wait()
    if backend == "nccl":
        torch.cuda.current_stream().synchronize()  # one bucket of extra memory at a time
    del keep


def receive_bucket(pg: Any, bucket: Spec, layout: str, backend: str) -> dict[str, torch.Tensor]:
    """Receiver side of one bucket (our own receivers; SGLang receives on its own)."""
    dev = _device(backend)
    dtypes = {d: getattr(torch, d.removeprefix("torch.")) for _, _, d in bucket}
    if layout == "per_tensor":
        out = {n: torch.empty(s, dtype=dtypes[d], device=dev) for n, s, d in bucket}
        works = [pg.broadcast(t, 0) for t in out.values()]
        for w in works:
            w.wait()
        return out
    sizes: dict[str, int] = {}
    for _, s, d in bucket:
        sizes[d] = sizes.get(d, 0) + int(torch.Size(s).numel())
    bufs = {d: torch.empty(n, dtype=dtypes[d], device=dev) for d, n in sizes.items()}
    works = [pg.broadcast(bufs[d], 0) for d in sorted(bufs, key=lambda d: str(dtypes[d]))]
    for w in works:
        w.wait()
    out, offsets = {}, dict.fromkeys(bufs, 0)
    for n, s, d in bucket:
        k = int(torch.Size(s).numel())
        out[n] = bufs[d][offsets[d]:offsets[d] + k].view(s)
        offsets[d] += k
    return out


class GroupSender:
    """Trainer rank 0's end of a weight sync (any object with a state dict can use it).

    `state_fn` returns the name -> tensor dict to send (trainer names); `names` maps them to
    engine names."""

    def __init__(self, state_fn: Callable[[], dict[str, torch.Tensor]],
                 names: NameMap | None = None) -> None:
        self.state_fn = state_fn
        self.names = names or NameMap()
        self.pg: Any = None
        self.backend = "gloo"
        self._ipc_keep: list[torch.Tensor] = []

    def state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for k, v in self.state_fn().items():
            mapped = self.names.map(k)
            if mapped is not None:
                out[mapped] = v
        return out

    def spec(self) -> Spec:
        return [(k, list(v.shape), str(v.dtype)) for k, v in self.state().items()]

    def open(self, host: str, port: int, world: int, backend: str, group_name: str,
             timeout_s: float = 1800.0) -> None:
        self.backend = backend
        self.pg = init_weight_group(backend, host, port, world, 0, group_name, timeout_s)

    def send(self, buckets: list[Spec] | None = None, layout: str = "flat",
             bucket_mb: float = 512.0) -> int:
        """Broadcast the state bucket by bucket; returns the bytes sent."""
        if self.pg is None:
            raise RuntimeError("send() before open(): the weight group is not formed")
        state = self.state()
        if buckets is None:
            buckets = plan_buckets([(k, list(v.shape), str(v.dtype)) for k, v in state.items()],
                                   bucket_mb)
        sent = 0
        for bucket in buckets:
            tensors = [state[n] for n, _, _ in bucket]
            broadcast_bucket(self.pg, tensors, layout, self.backend)
            sent += sum(t.numel() * t.element_size() for t in tensors)
        return sent

    def checksums(self, limits: dict[str, int | None], dtype: str | None) -> dict[str, int]:
        return checksum_state(self.state(), limits, dtype)

    def close(self) -> None:
        close_weight_group(self.pg)
        self.pg = None

    def ipc_payload(self, ranks: int = 1) -> list[bytes]:
        """The state on this GPU, as CUDA IPC handles (ForkingPickler), once per TP rank."""
        require_cuda("CUDA IPC weight sharing")
        from multiprocessing.reduction import ForkingPickler

        from torch.multiprocessing.reductions import init_reductions

        init_reductions()
        dev = _device("nccl")
        named = [(k, v.detach().to(dev).contiguous()) for k, v in self.state().items()]
        self._ipc_keep = [t for _, t in named]  # alive until the engines have copied them
        buf = io.BytesIO()
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(named)
        return [buf.getvalue()] * ranks

    def release_ipc(self) -> None:
        self._ipc_keep = []
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def load_ipc(payload: bytes) -> dict[str, torch.Tensor]:
    """Receiver side of CUDA IPC for our own engines: the shared tensors (no copy yet)."""
    require_cuda("CUDA IPC weight sharing")
    return dict(pickle.loads(payload))


class GroupReceiver:
    """An engine replica's end for engines without a weight group of their own (the torch
    backend on a GPU)."""

    def __init__(self, host: str, port: int, world: int, rank: int, backend: str,
                 group_name: str, timeout_s: float = 1800.0) -> None:
        self.backend = backend
        self.pg = init_weight_group(backend, host, port, world, rank, group_name, timeout_s)

    def receive(self, buckets: list[Spec], layout: str) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for bucket in buckets:
            out.update(receive_bucket(self.pg, bucket, layout, self.backend))
        return out

    def close(self) -> None:
        close_weight_group(self.pg)
        self.pg = None
