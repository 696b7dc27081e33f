"""Exact k-th smallest |x| over data seen in chunks (a two-pass radix select on fp32 bits).

For non-negative floats the int32 bit pattern is monotone in the value. Pass 1 counts the
high 16 bits of |x| (65536 bins) and picks the bin holding the k-th element; pass 2 counts
the low 16 bits of the elements in that bin. Both histograms add across chunks, tensors,
shards and Ray tasks, so TIES can trim over the whole model with O(65536) memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

BINS = 1 << 16


def _abs_bits(x: torch.Tensor) -> torch.Tensor:
    import torch

    return x.reshape(-1).abs().view(torch.int32)


def coarse_hist(x: torch.Tensor) -> np.ndarray:
    """Counts of |x| by the high 16 bits of its fp32 pattern."""
    import torch

    hi = torch.bitwise_right_shift(_abs_bits(x), 16)
    return torch.bincount(hi, minlength=BINS).numpy()


def inexact_hist(x: torch.Tensor) -> np.ndarray:
    """Counts by the high 16 bits of |x| of the entries whose low 16 bits are not all 0. A
    coarse bin with none holds one value only, so a k-th value found in it is exact without
    the fine pass (the usual case for bf16 experts: their task vectors have few bits)."""
    import torch

    bits = _abs_bits(x)
    hi = torch.bitwise_right_shift(bits, 16)[(bits & 0xFFFF) != 0]
    return torch.bincount(hi, minlength=BINS).numpy()


def fine_hist(x: torch.Tensor, hi: int) -> np.ndarray:
    """Counts of the low 16 bits of |x| among entries whose high 16 bits equal `hi`."""
    import torch

    bits = _abs_bits(x)
    lo = torch.where(torch.bitwise_right_shift(bits, 16) == hi, bits & 0xFFFF, BINS)
    return torch.bincount(lo, minlength=BINS + 1)[:BINS].numpy()


def locate(hist: np.ndarray, k: int) -> tuple[int, int]:
    """(bin holding the k-th smallest element (1-based), rank of that element in its bin)."""
    cum = np.cumsum(hist)
    if not 1 <= k <= int(cum[-1]):
        raise ValueError(f"k={k} outside 1..{int(cum[-1])}")
    b = int(np.searchsorted(cum, k))
    before = int(cum[b - 1]) if b else 0
    return b, k - before


def value(hi: int, lo: int) -> float:
    """The fp32 value of the bit pattern (hi << 16) | lo."""
    return float(np.array([(hi << 16) | lo], dtype=np.uint32).view(np.float32)[0])


def kth_smallest_abs(x: torch.Tensor, k: int) -> float:
    """k-th smallest |x| (1-based) of one in-memory tensor, via the two passes."""
    hi, rank = locate(coarse_hist(x), k)
    lo, _ = locate(fine_hist(x, hi), rank)
    return value(hi, lo)


def paper_rank(d: int, density: float) -> int:
    """The TIES paper's cut-off rank: kthvalue(d - int(d * K)), keeping |x| >= it
    (int(d * K) + 1 entries plus ties). 0 means keep everything."""
    return d - int(d * density)


def topk_rank(d: int, density: float) -> int:
    """mergekit's per-tensor cut-off: the k-th largest with k = int(density * d), i.e. rank
    d - k + 1 from below; d + 1 means keep nothing, 0 keep everything (density >= 1)."""
    if density >= 1.0:
        return 0
    return d - int(density * d) + 1
