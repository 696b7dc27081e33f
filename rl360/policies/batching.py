"""What the trainers step over: micro-batches (right-padded tensors of samples), the metric
accumulator that averages per-token metrics over micro-batches and ranks, the even split of a
batch into minibatches, and the checks a batch must pass before any forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rl360.policies.shared_prefix import PrefixLayout
from rl360.types import TrainSample


@dataclass
class MicroBatch:
    """B sequences. The model sees `ids`: B right-padded rows, or (packed) one row of the
    sequences back to back with per-sequence `positions`. Everything the loss reads is in the
    padded [B, L-1] layout; `padded` brings per-target values of a packed row into it."""

    ids: Tensor  # [B, L] right-padded, or [1, T] packed
    attn: Tensor | None  # [B, L] padding mask (None when packed)
    mask: Tensor  # [B, L-1] loss mask on targets ids[:, 1:]
    sampling: Tensor  # [B, L-1]
    adv: Tensor  # [B]
    old: Tensor | None = None  # [B, L-1] proximal logprobs (None: the current ones, detached)
    rows: list[int] = field(default_factory=list)  # the samples' indices in the batch
    positions: Tensor | None = None  # [1, T]: position ids of a packed row
    unpack: Tensor | None = None  # [B, L-1]: index of each target in the packed row's T-1
    prefix: PrefixLayout | None = None  # rows sharing a prompt run it once (shared_prefix.py)

    def padded(self, x: Tensor) -> Tensor:
        """Per-target values [R, W-1] of what the model saw -> the padded [B, L-1] layout."""
        return x if self.unpack is None else x[0][self.unpack]

    def to(self, device: torch.device) -> MicroBatch:
        if device.type == "cpu":
            return self
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=True)
                 for f in fields(self) if isinstance(getattr(self, f.name), Tensor)}
        if self.prefix is not None:
            moved["prefix"] = self.prefix.to(device)
        return replace(self, **moved)


class StepMetrics:
    """Token-weighted means (keys not ending in _max) and maxima over micro-batches/ranks."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.maxes: dict[str, float] = {}

    def add(self, metrics: dict[str, Tensor | float], weight: float) -> None:
        for k, v in metrics.items():
            x = float(v)
            if k.endswith("_max"):
                self.maxes[k] = max(self.maxes.get(k, x), x)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + x * weight
                self.weights[k] = self.weights.get(k, 0.0) + weight

    def all_reduce(self, group: Any = None) -> None:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (self.sums, self.weights, self.maxes), group=group)
        self.sums, self.weights, self.maxes = {}, {}, {}
        for sums, weights, maxes in gathered:
            for k, v in sums.items():
                self.sums[k] = self.sums.get(k, 0.0) + v
                self.weights[k] = self.weights.get(k, 0.0) + weights[k]
            for k, v in maxes.items():
                self.maxes[k] = max(self.maxes.get(k, v), v)

    def result(self) -> dict[str, float]:
        out = {k: s / self.weights[k] if self.weights[k] > 0 else 0.0 for k, s in self.sums.items()}
        out.update(self.maxes)
        return out


def split_even(items: list[int], parts: int) -> list[list[int]]:
    """`items` in `parts` contiguous, near-equal parts (fewer when there are fewer items)."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (k < extra)
        out.append(items[start:end])
        start = end
    return out


def validate_samples(samples: list[TrainSample], vocab: int) -> None:
    for i, s in enumerate(samples):
        n = len(s.tokens)
        if n == 0 or len(s.mask) != n or len(s.sampling_logprobs) != n:
            raise ValueError(f"sample {i}: tokens, mask and sampling_logprobs need one nonzero "
                             f"length, got {n}, {len(s.mask)}, {len(s.sampling_logprobs)}")
        if s.mask[0]:
            raise ValueError(f"sample {i}: mask[0] is 1, but the first token has no prediction "
                             "(the loss mask marks target tokens)")
        lo, hi = min(s.tokens), max(s.tokens)
        if lo < 0 or hi >= vocab:
            raise ValueError(f"sample {i}: token id {lo if lo < 0 else hi} outside the "
                             f"model's vocab [0, {vocab})")
