"""Weight slots: node-local shared memory that the sender rewrites in place, version after version.

A full version put into the object store lands in pages the sender has never touched: the put
costs a minor page fault per 4 KiB (~25k for 100 MB), 4-8x the copy itself. A slot is a memfd
the sender (trainer rank 0) created and mapped once: writing a version into it is one memcpy
into mapped pages. Replicas on the sender's node map the slot once too (read-only, through
/proc/<sender pid>/fd/<fd>: nothing is left behind in /dev/shm when the sender dies) and serve
the version in place, as they serve an object-store version (packing.borrow_full).

A slot that a replica serves, or is about to load, must not be rewritten. The WeightPublisher
keeps the claims: the slot each replica serves (it says so with every report) and the slot of
the version handed to it by `wait_newer` until it applies a newer one. Each publish returns
the slots claimed then; the sender's next version goes to a slot outside that set and other
than the one it just wrote (between two publishes, new claims only go to the newest version's
slot). With every slot claimed (a replica that is stuck, or died holding one) and `max_slots`
made, the version goes into the object store as before. Replicas that cannot map a slot (on
another node, or /proc closed to them) say so and the sender stops using slots.
"""

from __future__ import annotations

import mmap
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_ALIGN = 64  # entry offsets inside a slot (cache lines; torch views need their dtype's alignment)
_HEADER = _ALIGN  # a slot starts with the int64 version its entries hold (0: being written)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: map (and allocate) every page in one call


def slot_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offset of each entry (`sizes` in bytes) in a slot, and the slot's size."""
    offsets, at = [], _HEADER
    for n in sizes:
        offsets.append(at)
        at += -(-n // _ALIGN) * _ALIGN
    return offsets, max(at, 1)


@dataclass
class Slot:
    """One memfd of the sender, mapped read-write."""

    nbytes: int
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    fd: int = -1
    mm: mmap.mmap | None = None

    def open(self) -> Slot:
        self.fd = os.memfd_create(f"rl360-weights-{self.id[:8]}")
        os.ftruncate(self.fd, self.nbytes)
        self.mm = mmap.mmap(self.fd, self.nbytes)
        try:  # allocate and map every page now, not as the first version is written
            self.mm.madvise(_MADV_POPULATE_WRITE)
        except OSError:
            np.frombuffer(self.mm, np.uint8)[::mmap.PAGESIZE] = 0
        return self

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
            os.close(self.fd)
            self.mm = None


@dataclass
class SlotWriter:
    """Sender side: at most `max_slots` slots of one version's size, written in place."""

    max_slots: int = 3
    slots: list[Slot] = field(default_factory=list)
    busy: set[str] = field(default_factory=set)  # claimed at the last publish
    last: str = ""  # the slot of the last version published from a slot
    disabled: str = ""  # why slots are not used any more ("" while they are)
    node: str = ""
    # copy threads: one per core this process may run on (a memcpy is bound by memory
    # bandwidth, which one core does not fill); 0: that count
    threads: int = 0
    _pool: ThreadPoolExecutor | None = None

    def reserve(self, arrays: list[np.ndarray]) -> tuple[Slot, dict[str, Any]] | None:
        """A free slot for a version's raw arrays, marked as being written, and its descriptor
        for the replicas; None when no slot is free and no more may be made."""
        if self.disabled:
            return None
        _, total = slot_offsets([a.nbytes for a in arrays])
        free = [s for s in self.slots if s.nbytes == total and s.id not in self.busy
                and s.id != self.last]
        if free:
            slot = free[0]
        elif len(self.slots) < self.max_slots:
            slot = Slot(total).open()
            self.slots.append(slot)
        else:
            return None
        assert slot.mm is not None
        np.frombuffer(slot.mm, np.int64, 1)[0] = 0
        self.node = self.node or _node_id()
        return slot, {"slot": slot.id, "path": f"/proc/{os.getpid()}/fd/{slot.fd}",
                      "pid": os.getpid(), "nbytes": total, "node": self.node}

    def fill(self, slot: Slot, arrays: list[np.ndarray], version: int) -> None:
        """Copy the version into the reserved slot, then stamp it with `version`."""
        assert slot.mm is not None
        offsets, _ = slot_offsets([a.nbytes for a in arrays])
        self._copy([(np.frombuffer(slot.mm, np.uint8, a.nbytes, off),
                     a.reshape(-1).view(np.uint8)) for a, off in zip(arrays, offsets, strict=True)])
        np.frombuffer(slot.mm, np.int64, 1)[0] = version  # after the copy threads joined

    def _copy(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Copy every (dst, src) byte pair, split into equal shares over the copy threads
        (numpy releases the GIL for a large copy)."""
        n = self.threads or len(os.sched_getaffinity(0))
        total = sum(src.nbytes for _, src in pairs)
        if n <= 1 or total < (8 << 20):
            _copy_all(pairs)
            return
        share = -(-total // n)
        jobs: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
        room = share
        for dst, src in pairs:
            at = 0
            while at < src.nbytes:
                k = min(room, src.nbytes - at)
                jobs[-1].append((dst[at:at + k], src[at:at + k]))
                at, room = at + k, room - k
                if room == 0:
                    jobs.append([])
                    room = share
        if self._pool is None:
            self._pool = ThreadPoolExecutor(n, thread_name_prefix="rl360-slot-copy")
        for f in [self._pool.submit(_copy_all, job) for job in jobs if job]:
            f.result()

    def published(self, answer: dict[str, Any], slot: str) -> bool:
        """What the publisher answered for the version written to `slot`: on "ok", the slots
        claimed at that moment (a refused version changes nothing: no replica was handed it);
        "stop": a replica cannot map slots, so versions go to the object store from now on."""
        if answer.get("stop"):
            self.disabled = str(answer["stop"])
        if not answer.get("ok"):
            return False
        self.busy, self.last = set(answer.get("busy", [])), slot
        return True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for s in self.slots:
            s.close()
        self.slots = []


def _copy_all(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)


class SlotReader:
    """Replica side: maps each slot once (read-only) and hands out views of a version in it."""

    def __init__(self) -> None:
        self.maps: dict[str, mmap.mmap] = {}
        self.pid: int | None = None  # the sender whose slots are mapped

    def arrays(self, desc: dict[str, Any], dtypes: list[np.dtype], counts: list[int]
               ) -> tuple[list[np.ndarray], bool]:
        """Read-only views of the version in slot `desc`, and whether this process had the
        slot mapped already (its pages are mapped: nothing to touch)."""
        mapped = desc["slot"] in self.maps
        if not mapped:
            if desc.get("node") and desc["node"] != _node_id():
                raise OSError(f"weight slot {desc['slot'][:8]} is on node {desc['node'][:8]}, "
                              "not this one")
            if desc.get("pid") != self.pid:  # a new sender: let the old one's slots go (a
                self.maps, self.pid = {}, desc.get("pid")  # view still held keeps its map)
            fd = os.open(desc["path"], os.O_RDONLY)
            try:
                self.maps[desc["slot"]] = mmap.mmap(fd, int(desc["nbytes"]), prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        mm = self.maps[desc["slot"]]
        sizes = [np.dtype(d).itemsize * n for d, n in zip(dtypes, counts, strict=True)]
        offsets, _ = slot_offsets(sizes)
        return [np.frombuffer(mm, d, n, off) for d, n, off
                in zip(dtypes, counts, offsets, strict=True)], mapped

    def stamp(self, desc: dict[str, Any]) -> int:
        """The version the slot (mapped by `arrays`) holds, as the sender stamped it after
        writing it (0: being written)."""
        return int(np.frombuffer(self.maps[desc["slot"]], np.int64, 1)[0])


def _node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception:  # outside a Ray worker there is no node to name
        pass
    return ""
