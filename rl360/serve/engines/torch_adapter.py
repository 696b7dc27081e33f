"""Adapter versions in the torch engine: the base weights it loaded plus a LoRA adapter.

The first `AdapterUpdate` (rl360.weights.payloads) wraps each target projection of the model
in `LoraLinear` (rl360.policies.lora: the trainer's own module, so the engine computes
x W^T + s (x A^T) B^T in the trainer's order); every version after it copies its A and B into
place (18.6 MiB for SmolLM2 at rank 16 in fp32) between two engine steps, like any in-flight
swap. The alternative, merging each version into the weights (W = W0 + s B A), keeps a second
copy of every adapted weight (W0) and recomputes them all per version;
bench/lora_engine.py measures both (see `PATH_REASON`).
"""

from __future__ import annotations

from typing import Any

from rl360.policies.lora import LoraSpec, add_lora, load_adapter_tensors
from rl360.weights.payloads import AdapterUpdate

PATH_REASON = "low-rank: see bench/lora_engine.py"


class EngineAdapter:
    """The adapter a torch engine's model serves (none until the first adapter version)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.spec: LoraSpec | None = None

    def apply(self, update: AdapterUpdate) -> None:
        """Serve `update`'s adapter from the next step on (on the engine thread). A version
        with another rank, alpha or targets than the first is refused (ValueError)."""
        spec = LoraSpec(rank=update.rank, alpha=update.alpha, targets=tuple(update.targets))
        if self.spec is None:
            add_lora(self.model, spec)
            self.spec = spec
        else:
            self.spec.require_like(spec, "adapter version")
        load_adapter_tensors(self.model, update.tensors, "adapter version")
