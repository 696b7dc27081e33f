"""Float bit-pattern arithmetic: ULP step distances, absorption on a store, and snapping.

ord maps a float's bit pattern b to b when the sign bit is clear and to sign - b otherwise,
so -0 and +0 both map to 0 and ord is monotone in the value: one representable step is one
unit of ord, across binades too (spec section 7). Works for bf16, fp16 and fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _layout(dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype, int]:
    """(integer view dtype, ordinal dtype, sign bit) for a float dtype."""
    import torch

    if dtype in (torch.bfloat16, torch.float16):
        return torch.int16, torch.int32, 1 << 15
    if dtype == torch.float32:
        return torch.int32, torch.int64, 1 << 31
    raise ValueError(f"ULP arithmetic supports bfloat16, float16 and float32, not {dtype}")


def ordinal(x: torch.Tensor) -> torch.Tensor:
    """Monotone integer ordinal of each float (int32 for 16-bit floats, int64 for fp32)."""
    import torch

    view, wide, sign = _layout(x.dtype)
    bits = x.contiguous().view(view).to(wide) & (2 * sign - 1)
    return torch.where(bits < sign, bits, sign - bits)


def from_ordinal(o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `ordinal` (an ordinal of 0 gives +0)."""
    import torch

    view, _, sign = _layout(dtype)
    bits = torch.where(o >= 0, o, sign - o)
    bits = torch.where(bits >= sign, bits - 2 * sign, bits)  # two's complement of the view
    return bits.to(view).view(dtype)


def steps(base: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """k = |ord(expert) - ord(base)|, in the base's storage dtype (the expert is rounded to it
    first when the two are stored differently)."""
    if expert.dtype != base.dtype:
        expert = expert.to(base.dtype)
    return (ordinal(expert) - ordinal(base)).abs()


def signed_steps(base: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """ord(value) - ord(base) in the base's dtype (value is rounded to it first)."""
    return ordinal(value.to(base.dtype)) - ordinal(base)


def absorbed(delta: torch.Tensor, base32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Entries whose update vanishes on a store in `dtype`: delta != 0 and
    cast(theta_0 + delta) == cast(theta_0)."""
    merged = (base32 + delta).to(dtype)
    return (delta != 0) & (merged == base32.to(dtype))


def snap(
    out: torch.Tensor, base32: torch.Tensor, delta: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Move the masked (absorbed) entries of `out` one representable step from cast(theta_0)
    toward sign(delta). Experimental: it rounds those updates up in magnitude."""
    import torch

    start = ordinal(base32.to(out.dtype))
    step = torch.sign(delta).to(start.dtype)
    moved = from_ordinal(start + step, out.dtype)
    return torch.where(mask, moved, out)
