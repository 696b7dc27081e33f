"""Counters gathered while merging, and the closing summary printed by `rl360 merge`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Stats:
    """Additive counters over the float tensors of a merge (plus the copied non-float ones)."""

    tensors: int = 0
    copied: int = 0  # non-float tensors copied from the base
    elements: int = 0
    nonzero: int = 0  # merged delta != 0
    changed: int = 0  # saved value != base value
    absorbed: int = 0  # delta != 0 but the saved (16-bit) value equals the base's
    absorbed_bf16: int = 0  # the same, had the output been saved in bf16
    snapped: int = 0  # absorbed entries moved one step (ulp_gate policy "snap")
    bf16_elements: int = 0  # elements saved in bf16 / fp16
    mass: list[float] = field(default_factory=list)  # per expert, L1 of its contribution
    method_counts: list[int] = field(default_factory=list)  # a method's own (TIES: signs)

    def add(self, other: Stats) -> None:
        for k, v in asdict(other).items():
            if isinstance(v, list):
                mine = getattr(self, k) or [0] * len(v)
                setattr(self, k, [a + b for a, b in zip(mine, v or [0] * len(mine), strict=True)])
            else:
                setattr(self, k, getattr(self, k) + v)


@dataclass
class Summary:
    method: str
    experts: list[str]
    out_dir: str
    out_dtypes: list[str]
    shards: int
    seconds: float
    bytes_read: int
    bytes_written: int
    stats: Stats
    passes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def shares(self) -> list[float]:
        total = sum(self.stats.mass)
        return [m / total if total else 0.0 for m in self.stats.mass]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shares"] = dict(zip(self.experts, self.shares, strict=True))
        d["changed_fraction"] = self.stats.changed / max(self.stats.elements, 1)
        return d

    def text(self) -> str:
        s = self.stats
        mbps = self.bytes_read / 1e6 / max(self.seconds, 1e-9)
        lines = [
            f"merged {len(self.experts)} experts with {self.method} -> {self.out_dir}",
            f"  output          {self.shards} shard(s), {'/'.join(self.out_dtypes)}, "
            f"{self.bytes_written / 1e6:.1f} MB in {self.seconds:.1f} s "
            f"({mbps:.0f} MB/s read, {1 + self.passes} pass(es))",
            f"  changed         {100 * s.changed / max(s.elements, 1):.4f}% of {s.elements:,} "
            f"elements ({s.changed:,}); merged delta nonzero at {s.nonzero:,}",
        ]
        if s.bf16_elements:
            line = f"  absorbed        {s.absorbed:,} updates lost to the 16-bit save"
            if s.snapped:
                line += f" ({s.snapped:,} snapped one step)"
            lines.append(line)
        if s.absorbed_bf16 or not s.bf16_elements:
            lines.append(f"  bf16 check      a bf16 save would absorb {s.absorbed_bf16:,} updates")
        shares = "  ".join(
            f"{n} {100 * v:.1f}%" for n, v in zip(self.experts, self.shares, strict=True)
        )
        lines.append(f"  expert shares   {shares}")
        if s.copied:
            lines.append(f"  copied          {s.copied} non-float tensor(s) from the base")
        for k, v in self.extra.items():
            lines.append(f"  {k:<15} {v}")
        return "\n".join(lines)
