"""The engine core's wire (rl360.serve.engines.core_process): the messages between a replica,
or a session shard, and its engine core, as length-prefixed msgpack frames; and the
shared-memory buffer a weight version crosses in (the replica writes it, the core maps it
read-only through /proc/<replica pid>/fd/<fd> and copies it into its parameters).
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import socket
import struct
from typing import Any

import msgspec

from rl360.recipe import EngineSection, ModelSection
from rl360.types import Generation, SamplingParams

_LEN = struct.Struct("<I")


class Start(msgspec.Struct, tag=True):
    engine: EngineSection
    model: ModelSection
    seed: int


class Gen(msgspec.Struct, tag=True):
    id: int
    prompt_ids: list[int]
    sampling: SamplingParams


class Cancel(msgspec.Struct, tag=True):
    id: int


class Call(msgspec.Struct, tag=True):
    """pause / resume / health / close, answered with Done."""

    id: int
    what: str


class Entry(msgspec.Struct, array_like=True):
    name: str
    dtype: str  # torch dtype name without "torch."
    shape: list[int]
    offset: int
    nbytes: int


class Update(msgspec.Struct, tag=True):
    id: int
    version: int
    pid: int  # the replica's process: the buffer is /proc/<pid>/fd/<fd>
    fd: int
    entries: list[Entry]


class Ready(msgspec.Struct, tag=True):
    pid: int
    health: dict[str, Any]


class GenDone(msgspec.Struct, tag=True):
    id: int
    gen: Generation


class Done(msgspec.Struct, tag=True):
    id: int
    value: Any = None


class Failed(msgspec.Struct, tag=True):
    id: int
    kind: str  # "value" (bad input) or "runtime"
    message: str


ToCore = Start | Gen | Cancel | Call | Update
FromCore = Ready | GenDone | Done | Failed

_encode = msgspec.msgpack.Encoder().encode


def frame(msg: msgspec.Struct) -> bytes:
    body = _encode(msg)
    return _LEN.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    return await reader.readexactly(n)


class CoreDied(RuntimeError):
    pass


def recv_frame_blocking(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("the engine core process closed its socket")
            buf += chunk
        return bytes(buf)

    (n,) = _LEN.unpack(exactly(_LEN.size))
    return exactly(n)


# ----------------------------------------------------------------------------- weight versions


class StagingBuffer:
    """The replica's shared-memory buffer a weight version is written into for the core (a
    memfd, grown when a version needs more, reused version after version: updates are
    serial, the core has copied a version out before it answers)."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("rl360-engine-core-weights", os.MFD_CLOEXEC)
        self.size = 0
        self.mm: mmap.mmap | None = None

    def stage(self, state: dict[str, Any]) -> list[Entry]:
        import numpy as np
        import torch

        from rl360.weights.slots import slot_offsets

        tensors = {k: torch.as_tensor(v) for k, v in state.items()}
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        offsets, at = slot_offsets(sizes)  # aligned as in a weight slot
        entries = [Entry(name, str(t.dtype).removeprefix("torch."), list(t.shape), off, n)
                   for (name, t), off, n in zip(tensors.items(), offsets, sizes, strict=True)]
        if at > self.size:
            if self.mm is not None:
                self.mm.close()
            os.ftruncate(self.fd, at)
            self.size = at
            self.mm = mmap.mmap(self.fd, at)
        assert self.mm is not None
        for e, t in zip(entries, tensors.values(), strict=True):
            if e.nbytes:
                dst = np.frombuffer(self.mm, np.uint8, e.nbytes, e.offset)
                np.copyto(dst, t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        return entries

    def close(self) -> None:
        if self.mm is not None:
            with contextlib.suppress(BufferError):
                self.mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def load_update(msg: Update) -> tuple[dict[str, Any], mmap.mmap]:
    import numpy as np
    import torch

    with open(f"/proc/{msg.pid}/fd/{msg.fd}", "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    state = {}
    for e in msg.entries:
        raw = np.frombuffer(mm, np.uint8, e.nbytes, e.offset)
        t = torch.frombuffer(raw, dtype=torch.uint8) if e.nbytes else torch.empty(0, dtype=torch.uint8)
        state[e.name] = t.view(getattr(torch, e.dtype)).reshape(e.shape)
    return state, mm
