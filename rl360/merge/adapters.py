"""LoRA adapters as merge experts: an adapter directory (peft's files, as `trainer.lora`
checkpoints are) stands for the expert base + delta, whose task vector on an adapted weight W
is the low-rank delta s * B @ A (s = alpha / r) and zero on every other tensor.

`AdapterExpert` answers the merge pipeline's reads like an expert checkpoint (`infos`, `read`)
and hands the dense loader the task vector itself (`delta`: s * B @ A in fp32, not the rounded
difference of two fp32 weights), so every method (task arithmetic, TIES, RAM, ...) acts on the
adapters' own deltas. One adapter merged onto its base with task arithmetic at lambda 1 (`rl360
merge --adapter DIR --out OUT`) is W + s * B @ A computed as the trainer's weight sync merges
it (rl360.policies.lora.merged_state): the model the engines served. The sparse loader (bitwise
comparison of stored experts) does not apply to adapters: there is nothing stored to compare.
Imports torch only when an adapter is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl360.merge import io
from rl360.merge.errors import MergeError

if TYPE_CHECKING:
    import torch

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # rl360.policies.lora's


def is_adapter(path: str | Path) -> bool:
    p = Path(path)
    return all((p / f).is_file() for f in ADAPTER_FILES)


class AdapterExpert:
    """An adapter directory over `base`: the base's tensors, adapted ones as W + s * B @ A."""

    def __init__(self, path: str | Path, label: str, base: str | Path, reader: str = "pread") -> None:
        from rl360.policies.lora import read_adapter

        self.path, self.label = Path(path), label
        self._base = io.Checkpoint(base, "base", reader)
        try:
            adapter = read_adapter(self.path)
        except (OSError, ValueError) as exc:
            raise MergeError(f"{label} {self.path}: {exc}") from None
        recorded = Path(adapter.base) if adapter.base else None
        if recorded is not None and recorded.is_dir() and (
                recorded.resolve() != self._base.path.resolve()):
            raise MergeError(f"{label} {self.path}: trained on base {recorded}, not on the "
                             f"merge's base {self._base.path}")
        self.scaling = adapter.spec.scaling
        self.infos = self._base.infos
        self._lowrank: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, a in adapter.tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key[: -len(".lora_A.weight")]
            b = adapter.tensors.get(f"{module}.lora_B.weight")
            info = self.infos.get(f"{module}.weight")
            if b is None:
                raise MergeError(f"{label} {self.path}: {key} has no lora_B beside it")
            if info is None or len(info.shape) != 2:
                raise MergeError(f"{label} {self.path}: adapts {module}.weight, which is not a "
                                 "matrix of the base")
            if (b.shape[0], a.shape[1]) != info.shape or b.shape[1] != a.shape[0]:
                raise MergeError(f"{label} {self.path}: {module}: B {list(b.shape)} @ A "
                                 f"{list(a.shape)} does not make the base's {list(info.shape)}")
            self._lowrank[f"{module}.weight"] = (a.float(), b.float())

    @property
    def adapted(self) -> list[str]:
        return sorted(self._lowrank)

    def delta(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """The task vector of tensor `name` in fp32, into `out` (zeros where not adapted)."""
        import torch

        ab = self._lowrank.get(name)
        if ab is None:
            return out.zero_()
        a, b = ab
        torch.matmul(b, a, out=out)
        return out.mul_(self.scaling)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The expert's tensor in the base's dtype: W + s * B @ A (fp32 sum, cast back)."""
        value = self._base.read(name, out)
        ab = self._lowrank.get(name)
        if ab is None:
            return value
        a, b = ab
        merged = (value.float() + (b @ a) * self.scaling).to(value.dtype)
        return value.copy_(merged)

    def read_bytes(self, name: str, start: int, out: Any) -> None:
        raise MergeError(f"{self.label}: an adapter expert is read whole (no sparse loading)")

    def close(self) -> None:
        self._base.close()


def open_expert(path: str | Path, label: str, reader: str, base: str | Path) -> Any:
    """An expert checkpoint directory, or an adapter directory over `base`."""
    if is_adapter(path):
        return AdapterExpert(path, f"expert '{label}'", base, reader)
    return io.Checkpoint(path, f"expert '{label}'", reader)
