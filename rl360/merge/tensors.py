"""Per-tensor pieces shared by the dense loader (shards.py) and the sparse one (sparse.py):
a planned output entry, reusable buffers, and theta_0 + delta cast to the output dtype with
its counts."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl360.merge import io, ulp
from rl360.merge.report import Stats
from rl360.merge.strategies import Parts

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    out_dtype: str
    is_float: bool


class Pool:
    """Named buffers reused from tensor to tensor: without them every tensor of the model
    would get fresh pages from the OS for its base, task vectors and reads (page faults are
    a large share of a merge's time). Each buffer grows to the largest tensor it has held."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def bytes(self, key: str, nbytes: int) -> torch.Tensor:
        import torch

        buf = self._bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            self._bufs.pop(key, None)
            buf = self._bufs[key] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]

    def tensor(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = dtype.itemsize
        for s in shape:
            n *= s
        return self.bytes(key, n).view(dtype).view(shape)


def tensor_stats(entry: Entry, numel: int, n: int) -> Stats:
    st = Stats(tensors=1, elements=numel, mass=[0.0] * n)
    st.bf16_elements = numel if entry.out_dtype in ("BF16", "F16") else 0
    return st


def finish_stats(entry: Entry, st: Stats) -> Stats:
    if entry.out_dtype == "BF16":
        st.absorbed_bf16 = st.absorbed
    return st


def merged_pieces(
    st: Stats, out_code: str, base32: torch.Tensor, parts: Parts, snap: bool, chunk: int
) -> Iterator[torch.Tensor]:
    """theta_0 + delta in the output dtype, part by part, counting changed and absorbed
    entries into `st` (and snapping absorbed ones one step under the "snap" policy)."""
    dtype = io.torch_dtype(out_code)
    base = base32.reshape(-1)
    for sl, merged in parts:
        st.mass = [a + b for a, b in zip(st.mass, merged.mass, strict=True)]
        if merged.counts:
            mine = st.method_counts or [0] * len(merged.counts)
            st.method_counts = [a + b for a, b in zip(mine, merged.counts, strict=True)]
        delta = merged.delta.reshape(-1)
        for s in range(0, delta.numel(), chunk):  # an Iso part is a whole matrix
            bc, dc = base[sl][s : s + chunk], delta[s : s + chunk]
            full = bc + dc
            oc, start = full.to(dtype), bc.to(dtype)
            nz = dc != 0
            lost = nz & (oc == start)
            st.nonzero += int(nz.sum())
            st.absorbed += int(lost.sum())
            if out_code != "BF16":
                st.absorbed_bf16 += int((nz & (full.bfloat16() == bc.bfloat16())).sum())
            if snap and bool(lost.any()):
                oc = ulp.snap(oc, bc, dc, lost)
                st.snapped += int(lost.sum())
            st.changed += int((oc != start).sum())
            yield oc
