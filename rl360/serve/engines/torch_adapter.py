"""Adapter versions in the torch engine: the base weights it loaded plus a LoRA adapter, merged.

Each `AdapterUpdate` (rl360.weights.payloads) is merged into the weights it adapts, W = W0 +
(alpha / rank) B A (`rl360.policies.lora.merged_weight`: the bits the trainer's merged weights
have), between two engine steps like any in-flight swap; W0, the base of every adapted weight,
is kept from the first version on. The engine's projections then stay plain Linears.

Merged per version rather than the low-rank path (each target computing x W^T + s (x A^T) B^T
every step, the trainer's LoraLinear): bench/lora_engine.py on SmolLM2-135M, rank 16 on the 7
attention and MLP projections, fp32, one thread, CPU milliseconds of a decode step: the
low-rank path took 1.17x the plain step with 1 row and 1.38x with 16 (two small matmuls and an
add more per projection, 210 projections a step), while a merge is one pass over the adapted
weights per version, and an RL run decodes hundreds of steps per version. The price is memory:
W0 is a second copy of the adapted weights (405 MiB for SmolLM2 in fp32).
"""

from __future__ import annotations

from typing import Any

import torch

from rl360.policies.lora import LoraSpec, layer_linears, merged_weight
from rl360.weights.packing import own_weights
from rl360.weights.payloads import AdapterUpdate


class EngineAdapter:
    """The adapter a torch engine's model serves, merged (none until the first version)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.spec: LoraSpec | None = None
        self.base: dict[str, torch.Tensor] = {}  # W0 of each adapted projection, by name
        self.tensors: dict[str, torch.Tensor] = {}  # the served version's A and B (checksums)

    def apply(self, update: AdapterUpdate) -> None:
        """Serve `update`'s adapter from the next step on (on the engine thread). A version
        with another rank, alpha or targets than the first is refused (ValueError), and so is
        one whose tensors are not the adapter of exactly those projections."""
        spec = LoraSpec(rank=update.rank, alpha=update.alpha, targets=tuple(update.targets))
        if self.spec is not None:
            self.spec.require_like(spec, "adapter version")
        targets = self._targets(spec)
        want = {f"{n}.lora_{p}.weight" for n in targets for p in "AB"}
        if set(update.tensors) != want:
            missing, extra = sorted(want - set(update.tensors)), sorted(set(update.tensors) - want)
            raise ValueError(f"adapter version: tensors do not match the model's projections "
                             f"(missing {missing[:2]}, unexpected {extra[:2]})")
        for n, lin in targets.items():
            a, b = update.tensors[f"{n}.lora_A.weight"], update.tensors[f"{n}.lora_B.weight"]
            if (tuple(a.shape) != (spec.rank, lin.in_features)
                    or tuple(b.shape) != (lin.out_features, spec.rank)):
                raise ValueError(f"adapter version: {n}: B {list(b.shape)} @ A {list(a.shape)} "
                                 f"does not fit [{lin.out_features}, {lin.in_features}] at rank "
                                 f"{spec.rank}")
        if self.spec is None:
            own_weights(self.model)  # the weights may view a published version: write our own
            self.base = {n: lin.weight.detach().clone() for n, lin in targets.items()}
            self.spec = spec
        with torch.no_grad():
            for n, lin in targets.items():
                a = update.tensors[f"{n}.lora_A.weight"].to(lin.weight.device)
                b = update.tensors[f"{n}.lora_B.weight"].to(lin.weight.device)
                lin.weight.copy_(merged_weight(self.base[n], a, b, spec.scaling))
        self.tensors = {k: v.detach().clone() for k, v in update.tensors.items()}

    def _targets(self, spec: LoraSpec) -> dict[str, torch.nn.Linear]:
        linears = layer_linears(self.model)
        found = {n: m for n, m in linears.items() if n.rsplit(".", 1)[-1] in spec.targets}
        have = {n.rsplit(".", 1)[-1] for n in linears}
        lacking = [t for t in spec.targets if t not in have]
        if lacking:
            raise ValueError(f"adapter version: {lacking[0]!r} is not a projection of the "
                             f"engine's model (it has: {', '.join(sorted(have))})")
        return found
