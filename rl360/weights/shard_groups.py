"""The moving half of sharded weight sync (rl360.weights.shards has the plan): the groups a
sharded sync runs over (one per sending trainer rank and epoch of membership, gloo or NCCL,
formed over a rendezvous store the rank opens on a port the kernel picks), a trainer rank's
`ShardSender` (its buckets cast into one buffer, checksummed, broadcast within a deadline;
its peak resident memory measured from the kernel's VmHWM) and a replica's `ShardReceiver`
(every rank's buckets at once, checked, assembled into staging tensors; `ShardBroken` when
anything is missing or corrupt, so nothing is half-applied)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch

from rl360.weights.payloads import dtype_bytes
from rl360.weights.shards import (
    TRAILER,
    RankPart,
    ShardPlan,
    Spec,
    bucket_checksum,
    bucket_limit,
    left,
    rank_part,
    signed,
)

# ----------------------------------------------------------------------------- groups


def listen(host: str, world: int, timeout_s: float) -> Any:
    """A rendezvous store for a group whose rank 0 is this process, on a port the kernel picks
    (held from here: no free-port race)."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, world, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class ShardGroup:
    """One sending rank and every replica (rank 0: the sender): a process group of its own
    (never the default one) over `store`, gloo or NCCL, formed within `timeout_s`."""

    def __init__(self, store: Any, rank: int, world: int, backend: str, name: str,
                 timeout_s: float) -> None:
        import torch.distributed as dist

        from rl360.weights.nccl import group_over_store

        self.backend, self.name, self.rank = backend, name, rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
            else torch.device("cpu")
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world,
                                            timedelta(seconds=timeout_s))
        else:
            self.pg = group_over_store(backend, store, rank, world, name, timeout_s)

    def broadcast(self, t: torch.Tensor, timeout_s: float) -> None:
        """Rank 0's `t` to every member, failing after `timeout_s`."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = timedelta(seconds=timeout_s)
        self.pg.broadcast([t], opts).wait()
        if self.backend == "nccl":
            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        if self.backend == "nccl":
            from rl360.weights.nccl import close_weight_group

            close_weight_group(self.pg)
        self.pg = None


def _join(host: str, port: int, rank: int, world: int, backend: str, name: str,
          timeout_s: float) -> ShardGroup:
    import torch.distributed as dist

    store = dist.TCPStore(host, port, world, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    return ShardGroup(store, rank, world, backend, name, timeout_s)


def group_name(epoch: int, rank: int) -> str:
    return f"rl360-shards-e{epoch}-r{rank}"


# ----------------------------------------------------------------------------- memory


def reset_peak_rss() -> int | None:
    """This process's resident bytes now, with the kernel's peak (VmHWM) reset to it; None
    where /proc does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb("VmRSS") * 1024
    except OSError:
        return None


def peak_rss() -> int:
    return _status_kb("VmHWM") * 1024


def current_rss() -> int:
    return _status_kb("VmRSS") * 1024


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {key}")


# ----------------------------------------------------------------------------- sender


class ShardSender:
    """A trainer rank's end. `state()`: the tensors this rank holds under HF names (DTensors
    for FSDP2); `rank`, `world`: its place in the trainer group."""

    def __init__(self, state: Callable[[], Mapping[str, torch.Tensor]], rank: int,
                 world: int) -> None:
        self.state, self.rank, self.world = state, rank, world
        self.part: RankPart | None = None
        self._settings: tuple[str | None, int] = (None, 0)
        self._stores: dict[int, Any] = {}  # epoch -> rendezvous store
        self._groups: dict[int, ShardGroup] = {}  # epoch -> formed group

    def layout(self, dtype: str | None, bucket_mb: float) -> RankPart:
        """This rank's part of the plan (kept: every send checks it still holds)."""
        limit = bucket_limit(bucket_mb)
        self.part, _ = rank_part(self.state(), self.rank, self.world, dtype, limit)
        self._settings = (dtype, limit)
        return self.part

    def listen(self, epoch: int, host: str, world: int, timeout_s: float) -> tuple[str, int]:
        """Open epoch `epoch`'s rendezvous (`world`: this rank + every replica); older epochs'
        groups are closed."""
        self.close(before=epoch)
        store = listen(host, world, timeout_s)
        self._stores[epoch] = (store, world)
        return host, int(store.port)

    def send(self, epoch: int, version: int, backend: str, form_timeout_s: float,
             timeout_s: float, checksum: bool = True) -> dict[str, Any]:
        """Form epoch `epoch`'s group (first send of the epoch, bounded by `form_timeout_s`)
        and broadcast this rank's buckets of the current weights, all of them within
        `timeout_s`. Returns bytes, buckets, seconds and the peak of this process's resident
        memory above where it started (None where /proc does not allow measuring it)."""
        if self.part is None:
            raise RuntimeError("sharded send before layout: no plan")
        t0 = time.perf_counter()
        before = reset_peak_rss()
        dtype, limit = self._settings
        part, held = rank_part(self.state(), self.rank, self.world, dtype, limit)
        if part.buckets != self.part.buckets or part.spec != self.part.spec:
            raise RuntimeError(f"trainer rank {self.rank}: the weights it holds changed shape "
                               "since the sync was planned")
        group = self._groups.get(epoch)
        if group is None:
            if epoch not in self._stores:
                raise RuntimeError(f"trainer rank {self.rank}: epoch {epoch} was not opened")
            store, world = self._stores[epoch]
            try:
                group = ShardGroup(store, 0, world, backend, group_name(epoch, self.rank),
                                   form_timeout_s)
            except Exception as exc:
                raise RuntimeError(f"trainer rank {self.rank}: weight group of epoch {epoch} "
                                   f"did not form within {form_timeout_s:g}s: {exc}") from exc
            self._groups[epoch] = group
        t1 = time.perf_counter()
        sources = {h.name: h for h in held}
        device = group.device
        size = max((b.nbytes for b in part.buckets), default=0) + TRAILER
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        deadline = time.perf_counter() + timeout_s
        try:
            for b in part.buckets:
                view = buf[:b.nbytes + TRAILER]
                for p in b.pieces:
                    h = sources[p.name]
                    es = dtype_bytes(h.dtype)
                    dst = view[p.offset:p.offset + p.numel * es].view(
                        getattr(torch, h.dtype.removeprefix("torch.")))
                    dst.copy_(h.flat[p.start - h.start:p.start - h.start + p.numel])
                tail = view[b.nbytes:].view(torch.int64)
                tail.fill_(signed(bucket_checksum(view[:b.nbytes])) if checksum else 0)
                group.broadcast(view, left(deadline))
        except Exception as exc:
            self.close()  # a group that failed once is not used again
            raise RuntimeError(f"trainer rank {self.rank}: version {version} (epoch {epoch}) "
                               f"broadcast failed: {str(exc).splitlines()[0][:300]}") from exc
        finally:
            del buf
        peak = peak_rss() - before if before is not None else None
        return {"rank": self.rank, "bytes": part.nbytes, "buckets": len(part.buckets),
                "form_s": t1 - t0, "send_s": time.perf_counter() - t1,
                "peak_extra_bytes": peak}

    def checksums(self) -> dict[str, tuple[int, int, int]]:
        """This rank's part of each tensor's checksum as the engines hold it (cast to the
        plan's dtype; rl360.weights.plan.partial_checksum): the parts of every rank add up to
        `tensor_checksum` of the full tensor, which no rank holds."""
        from rl360.weights.plan import partial_checksum

        dtype, limit = self._settings
        _, held = rank_part(self.state(), self.rank, self.world, dtype, limit)
        out: dict[str, tuple[int, int, int]] = {}
        step = 1 << 22
        for h in held:
            cast = getattr(torch, h.dtype.removeprefix("torch."))
            total = words = width = 0
            for at in range(0, h.flat.numel(), step):
                t, w, width = partial_checksum(h.flat[at:at + step].to(cast), h.start + at)
                total, words = total + t, words + w
            out[h.name] = (total, words, width)
        return out

    def close(self, before: int | None = None) -> None:
        """Leave the groups (of epochs before `before`; all when None)."""
        for e in [e for e in self._groups if before is None or e < before]:
            self._groups.pop(e).close()
        for e in [e for e in self._stores if before is None or e < before]:
            del self._stores[e]


# ----------------------------------------------------------------------------- receiver
class ShardBroken(RuntimeError):
    """A version that did not arrive whole (a bucket failed its checksum, a sender or the
    group failed or timed out): nothing of it is applied."""


class ShardReceiver:
    """A replica's end: the groups of the epoch it belongs to (one per sending rank) and the
    staging tensors a version is assembled in (kept between versions; handed to the engine,
    which copies them, so valid until the next receive)."""

    def __init__(self) -> None:
        self.epoch = -1
        self.groups: dict[int, ShardGroup] = {}
        self.staging: dict[str, torch.Tensor] = {}
        self._spec: Spec = []

    def join(self, epoch: int, senders: dict[int, tuple[str, int]], rank: int, world: int,
             backend: str, timeout_s: float) -> None:
        """Join epoch `epoch`'s group of every sending rank (all at once), as `rank` of
        `world`; raises ShardBroken when one does not form within `timeout_s`."""
        self.close()
        self.epoch = epoch

        def one(r: int) -> ShardGroup:
            host, port = senders[r]
            return _join(host, port, rank, world, backend, group_name(epoch, r), timeout_s)

        with ThreadPoolExecutor(max_workers=max(1, len(senders)),
                                thread_name_prefix="rl360-shard-join") as pool:
            futures = {r: pool.submit(one, r) for r in senders}
            errors = []
            for r, f in futures.items():
                try:
                    self.groups[r] = f.result()
                except Exception as exc:
                    errors.append(f"rank {r}: {str(exc).splitlines()[0][:200]}")
        if errors:
            self.close()
            raise ShardBroken(f"epoch {epoch} groups did not form within {timeout_s:g}s: "
                              + "; ".join(errors))

    def _stage(self, spec: Spec, device: torch.device) -> None:
        if spec != self._spec or any(t.device != device for t in self.staging.values()):
            self.staging = {n: torch.empty(s, dtype=getattr(torch, d.removeprefix("torch.")),
                                           device=device) for n, s, d in spec}
            self._spec = spec

    def receive(self, plan: ShardPlan, timeout_s: float, checksum: bool = True
                ) -> dict[str, torch.Tensor]:
        """Every rank's buckets of one version, at once, within `timeout_s`; the assembled
        full tensors (tied names alias their tensor). Raises ShardBroken when anything is
        missing or corrupt."""
        if not self.groups:
            raise ShardBroken("receive before join")
        device = next(iter(self.groups.values())).device
        self._stage(plan.spec, device)
        dtypes = {n: d for n, _, d in plan.spec}
        deadline = time.perf_counter() + timeout_s

        def from_rank(r: int) -> None:
            buckets = plan.ranks[r]
            group = self.groups[r]
            buf = torch.empty(max(b.nbytes for b in buckets) + TRAILER, dtype=torch.uint8,
                              device=device)
            for i, b in enumerate(buckets):
                view = buf[:b.nbytes + TRAILER]
                group.broadcast(view, left(deadline))
                if checksum:
                    want = int(view[b.nbytes:].view(torch.int64).item())
                    got = signed(bucket_checksum(view[:b.nbytes]))
                    if want != got:
                        raise ShardBroken(f"bucket {i} of rank {r} failed its checksum")
                for p in b.pieces:
                    dt = dtypes[p.name]
                    src = view[p.offset:p.offset + p.numel * dtype_bytes(dt)].view(
                        getattr(torch, dt.removeprefix("torch.")))
                    self.staging[p.name].view(-1)[p.start:p.start + p.numel].copy_(src)

        errors = []
        with ThreadPoolExecutor(max_workers=max(1, len(self.groups)),
                                thread_name_prefix="rl360-shard-recv") as pool:
            futures = {r: pool.submit(from_rank, r) for r in self.groups}
            for r, f in futures.items():
                try:
                    f.result()
                except Exception as exc:
                    errors.append(f"rank {r}: {str(exc).splitlines()[0][:200]}")
        if errors:
            self.close()
            raise ShardBroken("; ".join(errors))
        out = dict(self.staging)
        for alias, name in plan.aliases.items():
            out[alias] = self.staging[name]
        return out

    def close(self) -> None:
        for g in self.groups.values():
            g.close()
        self.groups = {}
