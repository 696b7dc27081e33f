"""Where the torch engine and the torch trainers compute: `select_device` turns a recipe's
`num_gpus` and `dtype` plus the CUDA devices this process sees into a torch device and dtype.

Ray gives an actor / Serve replica that reserved GPUs a CUDA_VISIBLE_DEVICES naming only those,
so the reserved GPU is always `cuda:0` of the process. `num_gpus = 0` keeps the CPU path exactly
as it was (the CUDA devices are not even looked at). A fractional `num_gpus` (several replicas
sharing one GPU) still means "compute on the GPU".

`place_for_generation` adapts an HF causal LM that lives on a GPU to a caller that builds its
inputs on the CPU (the torch engine's batch loop): inputs move to the model's device before each
forward, and the last position's logits come back to the CPU (sampling runs there, with CPU
generators seeded per request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype  # the dtype compute runs in (the engine's weights; the trainer's autocast)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def visible_cuda_devices() -> int:
    """CUDA devices this process may use (0 without a CUDA build or driver)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:  # a broken driver: as good as none
        return 0


def select_device(
    num_gpus: float, dtype: str, *, gpus_key: str, dtype_key: str, cuda_devices: int | None = None
) -> Placement:
    """The device and dtype for a recipe's `num_gpus` and `dtype` (`gpus_key`, `dtype_key`:
    the recipe keys they came from, named in errors, e.g. "engine.num_gpus", "model.dtype").
    `cuda_devices`: how many CUDA devices are visible (None: ask torch)."""
    if dtype not in DTYPES:
        raise ValueError(f"{dtype_key} {dtype!r} not in {sorted(DTYPES)}")
    if num_gpus < 0:
        raise ValueError(f"{gpus_key} must be >= 0, got {num_gpus}")
    if num_gpus == 0:
        return Placement(torch.device("cpu"), DTYPES[dtype])
    visible = visible_cuda_devices() if cuda_devices is None else cuda_devices
    if visible <= 0:
        gpus = f"{num_gpus:g}"
        raise RuntimeError(
            f"{gpus_key} = {gpus} but this process sees no CUDA device (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}): install a CUDA "
            f"torch on the GPU nodes, or set {gpus_key} = 0 to run on CPUs"
        )
    return Placement(torch.device("cuda", 0), DTYPES[dtype])


def place_for_generation(model: Any, placement: Placement) -> Any:
    """Move `model` to the placement's device (weights in its dtype). On a GPU, forward
    hooks move CPU inputs to the GPU and bring the LAST position's logits back to the CPU
    (shape [B, 1, V]: what a decoder samples from); the KV cache stays on the GPU."""
    model = model.to(device=placement.device, dtype=placement.dtype)
    if not placement.cuda:
        return model
    device = placement.device

    def inputs_to_device(_mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return args, kwargs

    def last_logits_to_cpu(_mod: Any, _args: Any, _kwargs: Any, out: Any) -> Any:
        out.logits = out.logits[:, -1:, :].to("cpu")
        return out

    model.register_forward_pre_hook(inputs_to_device, with_kwargs=True)
    model.register_forward_hook(last_logits_to_cpu, with_kwargs=True)
    return model


