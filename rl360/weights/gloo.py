"""The gloo group of the CPU collective transport: trainer rank 0 and every engine replica in a
torch.distributed gloo group of their own; a version goes as one flat buffer per dtype,
broadcast in chunks (rl360.weights.transports.CollectiveTransport)."""

from __future__ import annotations

from datetime import timedelta

import torch

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64)}


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
    trainer rank and Serve replicas can join one without disturbing their other groups.

    Both ends keep their flat per-dtype buffers between versions (no fresh allocation and page
    faults per version), and a buffer goes as several broadcasts of `chunk_mb` in flight at
    once, which keeps the group's threads and sockets busy together."""

    def __init__(self, host: str, port: int, rank: int, world: int, timeout_s: float = 300.0,
                 chunk_mb: float = 16.0) -> None:
        import torch.distributed as dist

        self.rank, self.world = rank, world
        self.chunk = max(1, int(chunk_mb * 1024 * 1024))
        store = dist.TCPStore(host, port, world, is_master=rank == 0,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        self.pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))
        self._bufs: dict[str, torch.Tensor] = {}

    def broadcast(self, buffers: dict[str, torch.Tensor]) -> None:
        works = []
        for d in sorted(buffers):
            flat = buffers[d]
            step = max(1, self.chunk // flat.element_size())
            for start in range(0, flat.numel(), step):
                works.append(self.pg.broadcast(flat[start:start + step], 0))
        for w in works:
            w.wait()

    def _buffers(self, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        if {d: b.numel() for d, b in self._bufs.items()} != sizes:
            self._bufs = {d: torch.empty(n, dtype=_DTYPES[d]) for d, n in sizes.items()}
        return self._bufs

    def send(self, state: dict[str, torch.Tensor]) -> None:
        groups: dict[str, list[torch.Tensor]] = {}
        for v in state.values():
            groups.setdefault(str(v.dtype), []).append(v.detach().reshape(-1))
        bufs = self._buffers({d: sum(t.numel() for t in ts) for d, ts in groups.items()})
        for d, ts in groups.items():
            torch.cat(ts, out=bufs[d])
        self.broadcast(bufs)

    def receive(self, spec: list[tuple[str, list[int], str]]) -> dict[str, torch.Tensor]:
        """Views into this group's buffers: valid until the next receive."""
        bufs = self._buffers(buffer_sizes(spec))
        self.broadcast(bufs)
        return unflatten(spec, bufs)
