"""Shims that let megatron-core 0.16 run on a CPU-only machine (data and tensor parallel
over gloo; PP = CP = EP = 1).

Used ONLY when CUDA is unavailable (`rl360.policies.megatron.model` calls `install()` then);
on GPUs megatron runs unpatched. Everything patched is listed here, and nowhere else:

1. `torch.cuda.current_device()` returns `torch.device("cpu")`. megatron-core moves some
   tensors with `.to(torch.cuda.current_device())` (e.g. RoPE's `inv_freq` in
   `RotaryEmbedding.get_emb`), which raises "Cannot access accelerator device" without a GPU.
   Returning the CPU device makes those moves no-ops.
2. The model-parallel RNG tracker (`megatron.core.tensor_parallel.random`) is replaced by one
   whose `fork()` is a no-op context. The real tracker saves/restores CUDA generator states
   around dropout and TP weight init; with dropout 0 and weights loaded from the HF
   checkpoint (megatron's own init is off) there is no randomness to isolate per TP rank.

Not shimmed, avoided instead: the default causal mask (megatron builds it with
device="cuda") — the trainer passes an explicit causal mask; fused kernels (apex / TE) — the
model config turns every fusion off and uses the local (non-TE) layer spec.

`install()` is idempotent and refuses to run when CUDA is available.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_installed = False


class CpuRngTracker:
    """Stands in for megatron's CudaRNGStatesTracker on CPU: named states are only recorded
    (their seeds), forking them changes nothing."""

    def __init__(self) -> None:
        self.seeds: dict[str, int] = {}

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self.seeds = {}

    def get_states(self) -> dict[str, int]:
        return dict(self.seeds)

    def set_states(self, states: dict[str, Any]) -> None:
        self.seeds = dict(states)

    def add(self, name: str, seed: int) -> None:
        self.seeds[name] = seed

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        yield


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def install() -> None:
    """Apply the shims (once per process)."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron cpu_shims must not be installed on a machine with CUDA")
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _installed = True
