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

A version's message hops (sender -> publisher -> replicas, ~1 ms each here) are taken off its
path: after each publish the sender picks the slot its next version will go to and tells the
publisher, which hands that hint to the replicas with their next poll. A replica holding a
hint sleeps in the kernel (futex(2) on a counter in the slot's header, no CPU) until the
sender, done writing, stamps the slot and wakes it, and loads the version at once; the
publisher's announcement then finds it served. The hint claims its slot from the moment it
is handed out: the sender may write the one version after the hint into it, nothing later
until the replica has moved on.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import mmap
import os
import platform
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger("rl360.weights")

_ALIGN = 64  # entry offsets inside a slot (cache lines; torch views need their dtype's alignment)
# a slot's header: the int64 version its entries hold (0: being written, ABANDONED: a write
# that failed), then at byte 8 an int32 counter of finished writes (what replicas wait on)
_HEADER = _ALIGN
_WRITES_AT = 8
ABANDONED = -1
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: map (and allocate) every page in one call


# glibc copies a block with streaming (non-temporal) stores from this size up: they do not read
# the destination's cache lines before writing them, and the sender never reads a slot again.
# glibc derives its own threshold from the cache size (114 MiB on a box with a 300 MiB L3:
# never, for a slot's copies of one tensor each) and reads the setting once, at start-up, so
# the sender's process is started with it (`writer_env`). Measured on that machine: a 102 MB
# version into a slot, 2 threads, 9.0 ms with glibc's threshold, 4.9 ms with this one.
STREAM_FROM_BYTES = 1 << 20


def writes_slots(slots: int, zero_copy: bool, delta: bool) -> bool:
    """Whether a sender writes weight slots: it has some, and it sends full versions that the
    replicas serve in place (a delta or a copied load has nothing to serve out of a slot)."""
    return slots > 0 and zero_copy and not delta


def writer_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Environment variables for the process that writes weight slots (trainer rank 0): its
    large copies use streaming stores. Nothing on other CPUs than x86-64, or when the caller
    set that threshold itself; other GLIBC_TUNABLES it has are kept."""
    have = environ.get("GLIBC_TUNABLES", "")
    if platform.machine() != "x86_64" or "x86_non_temporal_threshold" in have:
        return {}
    tunable = f"glibc.cpu.x86_non_temporal_threshold={STREAM_FROM_BYTES:#x}"
    return {"GLIBC_TUNABLES": f"{have}:{tunable}" if have else tunable}


def _header(mm: mmap.mmap) -> tuple[np.ndarray, np.ndarray]:
    """A slot's version stamp and its count of finished writes, as views of the mapping."""
    return np.frombuffer(mm, np.int64, 1), np.frombuffer(mm, np.int32, 1, _WRITES_AT)


# futex(2) on the counter, shared across the processes that map the slot: FUTEX_WAIT sleeps
# while the word holds the value the waiter saw, FUTEX_WAKE wakes every sleeper
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine(), 0)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_libc() -> ctypes.CDLL | None:
    if not _SYS_FUTEX:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # ctypes lets the GIL go while it blocks
    except OSError:
        return None
    libc.syscall.restype = ctypes.c_long
    return libc


_LIBC = _load_libc()
CAN_WAIT = _LIBC is not None  # replicas can sleep on a slot: senders hand out hints


def _futex(addr: int, op: int, value: int, timeout_s: float | None = None) -> None:
    assert _LIBC is not None
    ts = None if timeout_s is None else ctypes.byref(
        _Timespec(int(timeout_s), int(timeout_s % 1 * 1e9)))
    _LIBC.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(op),
                  ctypes.c_int(value), ts, None, ctypes.c_int(0))


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
    written: int = 0  # the version last written into it (0: none)

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
    # the slot promised to the replicas (a hint) for the version after the last one, and the
    # layout it was promised for; the next version of that layout goes there
    promised: tuple[Slot, Any] | None = None
    disabled: str = ""  # why slots are not used any more ("" while they are)
    node: str = ""
    # copy threads: one per core this process may run on (a memcpy is bound by memory
    # bandwidth, which one core does not fill); 0: that count
    threads: int = 0
    _pool: ThreadPoolExecutor | None = None

    def _free(self, total: int) -> Slot | None:
        """A slot of `total` bytes outside the claims and other than the last one written (a
        new one while fewer than `max_slots` exist); None when there is none."""
        if self.disabled:
            return None
        free = [s for s in self.slots if s.nbytes == total and s.id not in self.busy
                and s.id != self.last]
        if free:  # the one written most recently: its pages are likelier still in the cache
            return max(free, key=lambda s: s.written)
        if len(self.slots) < self.max_slots:
            self.slots.append(Slot(total).open())
            return self.slots[-1]
        return None

    def _desc(self, slot: Slot) -> dict[str, Any]:
        """What a replica needs to map the slot."""
        self.node = self.node or _node_id()
        return {"slot": slot.id, "path": f"/proc/{os.getpid()}/fd/{slot.fd}",
                "pid": os.getpid(), "nbytes": slot.nbytes, "node": self.node}

    def reserve(self, arrays: list[np.ndarray], layout: Any = None
                ) -> tuple[Slot, dict[str, Any]] | None:
        """A free slot for a version's raw arrays (the promised one when the version has the
        layout it was promised for), marked as being written, and its descriptor for the
        replicas; None when no slot is free and no more may be made."""
        _, total = slot_offsets([a.nbytes for a in arrays])
        promised, self.promised = self.promised, None
        if promised is not None and promised[0].nbytes == total and promised[1] == layout \
                and not self.disabled:
            slot: Slot | None = promised[0]
        else:
            if promised is not None:  # replicas asleep on it expect the promised layout
                self.busy.add(promised[0].id)
            slot = self._free(total)
        if slot is None:
            return None
        assert slot.mm is not None
        _header(slot.mm)[0][0] = 0
        return slot, self._desc(slot)

    def promise(self, layout: Any) -> dict[str, Any] | None:
        """After a publish: the slot the next version of `layout` will be written into (its
        descriptor, for the replicas to wait on), or None (no slot free, or replicas could
        not sleep on it here)."""
        if not CAN_WAIT or not self.last:
            return None
        written = next(s for s in self.slots if s.id == self.last)
        slot = self._free(written.nbytes)
        self.promised = None if slot is None else (slot, layout)
        return None if slot is None else self._desc(slot)

    def fill(self, slot: Slot, arrays: list[np.ndarray], version: int) -> None:
        """Copy the version into the reserved slot, stamp it with `version` (ABANDONED when the
        copy fails) and wake the replicas sleeping on it."""
        assert slot.mm is not None
        offsets, _ = slot_offsets([a.nbytes for a in arrays])
        stamp, writes = _header(slot.mm)
        try:
            self._copy([(np.frombuffer(slot.mm, np.uint8, a.nbytes, off),
                         a.reshape(-1).view(np.uint8))
                        for a, off in zip(arrays, offsets, strict=True)])
            stamp[0] = version  # after the copy threads joined
            slot.written = version
        except BaseException:
            stamp[0] = ABANDONED
            raise
        finally:
            writes[0] += 1
            if _LIBC is not None:
                _futex(writes.ctypes.data, _FUTEX_WAKE, 2**31 - 1)

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
        claimed at that moment; "stop": a replica cannot map slots, so versions go to the
        object store from now on."""
        if answer.get("stop"):
            self.disabled = str(answer["stop"])
        if not answer.get("ok"):
            # replicas asleep on a promised slot may have loaded the version all the same:
            # the slot stays out of use until a publish says who serves what
            self.busy.add(slot)
            return False
        self.busy, self.last = set(answer.get("busy", [])), slot
        return True

    def broken_promise(self) -> None:
        """The next version goes outside the slots: the promised slot stays out of use (replicas
        may still be asleep on it) until a publish says what is claimed."""
        if self.promised is not None:
            self.busy.add(self.promised[0].id)
            self.promised = None

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
        mapped = not self.map(desc)
        mm = self.maps[desc["slot"]]
        sizes = [np.dtype(d).itemsize * n for d, n in zip(dtypes, counts, strict=True)]
        offsets, _ = slot_offsets(sizes)
        return [np.frombuffer(mm, d, n, off) for d, n, off
                in zip(dtypes, counts, offsets, strict=True)], mapped

    def map(self, desc: dict[str, Any]) -> bool:
        """Map slot `desc` unless it is mapped already; True when it was mapped now (OSError:
        this process cannot map it)."""
        if desc["slot"] in self.maps:
            return False
        if desc.get("node") and desc["node"] != _node_id():
            raise OSError(f"weight slot {desc['slot'][:8]} is on node {desc['node'][:8]}, "
                          "not this one")
        if desc.get("pid") != self.pid:  # a new sender: let the old one's slots go (a view
            self.maps, self.pid = {}, desc.get("pid")  # still held keeps its mapping)
        fd = os.open(desc["path"], os.O_RDONLY)
        try:
            self.maps[desc["slot"]] = mmap.mmap(fd, int(desc["nbytes"]), prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return True

    def stamp(self, desc: dict[str, Any]) -> int:
        """The version the slot (mapped by `arrays`) holds, as the sender stamped it after
        writing it (0: being written; ABANDONED)."""
        return int(_header(self.maps[desc["slot"]])[0][0])

    def wait_newer(self, desc: dict[str, Any], after: int, stop: threading.Event,
                   slice_s: float = 0.25) -> int:
        """Sleep until the slot (mapped by `arrays`) holds a version newer than `after`, and
        return it; 0 once `stop` is set or the sender's process is gone (ABANDONED: its write
        failed). Wakes every `slice_s` to look at `stop`."""
        stamp, writes = _header(self.maps[desc["slot"]])
        while not stop.is_set():
            seen = int(writes[0])
            version = int(stamp[0])
            if version > after or version == ABANDONED:
                return version
            if not os.path.exists(f"/proc/{desc['pid']}"):
                return 0
            _futex(writes.ctypes.data, _FUTEX_WAIT, seen, slice_s)
        return 0


@dataclass
class SlotWatch:
    """A replica asleep on the slot its sender said the version after `after` goes to."""

    after: int
    slot: str
    desc: dict[str, Any]
    layout: Any
    task: asyncio.Task[int]
    writes: np.ndarray  # the slot's write counter (a view: it keeps the mapping alive)
    stop_event: threading.Event

    @classmethod
    def start(cls, reader: SlotReader, after: int, desc: dict[str, Any], layout: Any,
              name: str) -> SlotWatch | None:
        """Start sleeping on slot `desc` (a thread blocked in the kernel); None when the slot
        cannot be mapped here (the publisher's announcement then says the rest)."""
        if not CAN_WAIT:
            return None
        try:
            reader.map(desc)
        except OSError:
            return None
        stop = threading.Event()
        task = asyncio.get_running_loop().create_task(
            asyncio.to_thread(reader.wait_newer, desc, after, stop), name=name)
        writes = _header(reader.maps[desc["slot"]])[1]
        return cls(after, str(desc["slot"]), desc, layout, task, writes, stop)

    def payload(self) -> tuple[int, dict[str, Any] | None]:
        """The version the slot now holds as a publisher would hand it out ((0, None): none)."""
        try:
            version = self.task.result()
        except Exception as e:  # the watch is a shortcut: the publisher's poll stays the way
            log.warning("waiting on weight slot %s failed: %r", self.slot[:8], e)
            return 0, None
        if version <= self.after:
            return 0, None
        return version, {"kind": "packed", "base": version, "version": version,
                         "full": self.desc, "layout": self.layout, "deltas": []}

    def stop(self) -> None:
        """Wake the sleeping thread and let it end (every sleeper on the slot re-checks)."""
        self.stop_event.set()
        _futex(self.writes.ctypes.data, _FUTEX_WAKE, 2**31 - 1)
        if not self.task.done():
            self.task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception:  # outside a Ray worker there is no node to name
        pass
    return ""
