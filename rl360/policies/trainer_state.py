"""A trainer's weights and state: what it sends to the engines (`state_dict_for_sync`, with
adapters merged; `adapter_for_sync`), and its checkpoints (`save` / `load`: the HF model, or
the adapter alone, plus trainer_state.pt with the step, optimizer, scheduler and RNG state).
`TrainerState` is a part of rl360.policies.trainer_torch.TorchTrainer (the fsdp and megatron
trainers override what they shard)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import Tensor

from rl360.policies.lora import (
    adapter_state,
    is_adapter_dir,
    load_adapter_tensors,
    merged_state,
    read_adapter,
    save_adapter,
)

STATE_FILE = "trainer_state.pt"


class TrainerState:
    """The weights-and-state part of a trainer; the trainer holds `model`, `lora`,
    `model_path`, `optimizer`, `scheduler`, `step`, `config` and `_side_files`, and
    `_load_pretrained(path)`."""

    model: Any
    lora: Any
    model_path: Path
    optimizer: Any
    scheduler: Any
    step: int
    config: Any
    _side_files: dict[str, bytes]

    def state_dict_for_sync(self) -> dict[str, Tensor]:
        """Detached, contiguous CPU copies under the HF names (tied weights share one copy).
        With adapters: the plain model's weights, each adapted one merged (W + s * B @ A)."""
        state = self.model.state_dict()
        merged: set[str] = set()
        if self.lora is not None:
            before = state
            state = merged_state(before, self.lora.scaling)
            merged = {k for k, v in state.items() if v is not before[k]}
        out: dict[str, Tensor] = {}
        seen: dict[tuple[Any, ...], Tensor] = {}
        for name, t in state.items():
            if name in merged:  # a fresh tensor already
                out[name] = t.detach().to("cpu").contiguous()
                continue
            key = (t.data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
            if key not in seen:
                seen[key] = t.detach().to("cpu", copy=True).contiguous()
            out[name] = seen[key]
        return out

    def adapter_for_sync(self) -> dict[str, Tensor]:
        """The adapter tensors alone (`<proj>.lora_A.weight`, `<proj>.lora_B.weight`): CPU
        copies."""
        if self.lora is None:
            raise RuntimeError("adapter_for_sync: this trainer has no trainer.lora adapters")
        return {k: v.detach().to("cpu", copy=True).contiguous()
                for k, v in adapter_state(self.model.state_dict()).items()}

    def save(self, out_dir: str | Path) -> Path:
        """HF safetensors + config + tokenizer files from the model path + trainer_state.pt;
        with adapters, the adapter alone (peft's files, naming its base) instead of the model."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            save_adapter(out, adapter_state(self.model.state_dict()), self.lora,
                         str(self.model_path.resolve()))
        else:
            self.model.save_pretrained(out, safe_serialization=True)
        for name, data in self._side_files.items():
            if not (out / name).exists():
                (out / name).write_bytes(data)
        self._write_state(out / STATE_FILE, self._train_state())
        return out

    def _train_state(self) -> dict[str, Any]:
        """What a resume needs besides the weights: step, optimizer, scheduler, RNG, config."""
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "config": msgspec.to_builtins(self.config),
        }

    @staticmethod
    def _write_state(path: Path, state: dict[str, Any]) -> None:
        tmp = path.with_name(f".{path.name}.tmp")  # whole file or none
        torch.save(state, tmp)
        tmp.replace(path)

    def load(self, in_dir: str | Path) -> None:
        """Restore weights, optimizer, scheduler, step and RNG state written by `save`."""
        src = Path(in_dir)
        if not (src / STATE_FILE).is_file():
            raise FileNotFoundError(f"{src} has no {STATE_FILE}: not a trainer checkpoint")
        if self.lora is not None:
            self._load_adapter(src)
        else:
            loaded = self._load_pretrained(src)
            with torch.no_grad():
                self.model.load_state_dict(loaded.state_dict(), strict=True)
            del loaded
        state = torch.load(src / STATE_FILE, map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self._restore_train_state(state)

    def _load_adapter(self, src: Path) -> None:
        """The adapter of a LoRA checkpoint into this trainer's adapters (same rank, alpha and
        targets; the base is this trainer's)."""
        if not is_adapter_dir(src):
            raise FileNotFoundError(f"{src} holds no LoRA adapter (trainer.lora is set): not a "
                                    "checkpoint of an adapter run")
        adapter = read_adapter(src)
        assert self.lora is not None
        self.lora.require_like(adapter.spec, str(src))
        load_adapter_tensors(self.model, adapter.tensors, str(src))

    def _restore_train_state(self, state: dict[str, Any]) -> None:
        """Scheduler, step and RNG state from a `_train_state()` dict."""
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(as_tuple(state["python_rng"]))


def as_tuple(x: Any) -> Any:
    """Lists back to tuples, nested (random.getstate() after a round trip through torch.save)."""
    return tuple(as_tuple(v) for v in x) if isinstance(x, list | tuple) else x
